"""One module per method: its loss near the top, its training loop below."""
