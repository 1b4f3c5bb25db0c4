"""Human preference labels: a local labeling page (`server`), one labeler's progress (`session`), the rows a label
becomes in the store's ``annotations`` row log (`labels`), and CSV/JSONL export and import (`files`).

See docs/labeling.md.
"""
