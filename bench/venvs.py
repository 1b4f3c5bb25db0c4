"""Virtual environments for benchmark peers (alpaca_eval, TRL), kept out of farmflow's own .venv."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def ensure_venv(folder: Path, requirements: list[str], share: bool = False) -> Path:
    """The python of a venv at `folder` holding the pinned `requirements`; created or completed when needed.

    With `share`, the venv also sees this interpreter's packages (torch, transformers,
    farmflow...) through a .pth file, and pip is held to their installed versions, so the
    peer runs on exactly the same stack and none of it is reinstalled or upgraded.
    A stamp written after a successful install records the requirements; without it (a
    first or interrupted install, other requirements) pip installs them again.
    """
    python, stamp = folder / "bin" / "python", folder / ".bench-requirements"
    wanted = "\n".join(requirements + (["shared: " + sys.prefix] if share else [])) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"installing {' '.join(requirements)} into {folder} (once)...", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    with tempfile.TemporaryDirectory() as tmp:
        if share:
            peer_site = subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            Path(peer_site, "_shared_site.pth").write_text(
                f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
            )
            freeze = subprocess.run(
                [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                capture_output=True,
                text=True,
                check=True,
            )
            constraints = Path(tmp) / "constraints.txt"
            constraints.write_text("\n".join(x for x in freeze.stdout.splitlines() if not x.startswith("-e ")) + "\n")
            pip += ["-c", str(constraints)]
        subprocess.run(pip + requirements, check=True)
    stamp.write_text(wanted)
    return python
