"""Every folder a command writes into the clone by default (or as the documentation shows it) is git-ignored, so
``git status`` after the README's commands shows no outputs. The folders are read from where they are defined:
Hydra's run and sweep directories, the ``--out`` defaults of the scripts, ``${OUT:-...}`` of the shell scripts,
the ``--out <folder>`` of the documented commands, and the libraries' own defaults."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT
from tests.test_readme_commands import DOCS

#: folders the libraries underneath write into the current directory when not told otherwise
LIBRARY_DEFAULTS = {
    "lightning_logs": "Lightning's default_root_dir (a Trainer without a logger directory)",
    "wandb": "W&B's run files (wandb.init without dir)",
    "site": "mkdocs build's site_dir",
}


def _first_part(path: str) -> str:
    return Path(path.strip()).parts[0]


def output_dirs() -> dict[str, str]:
    """Folder (relative to the clone) -> what writes it."""
    found = dict(LIBRARY_DEFAULTS)
    hydra = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hydra" / "default.yaml"))  # unresolved
    found[_first_part(hydra["run"]["dir"])] = "python run.py (hydra.run.dir)"
    found[_first_part(hydra["sweep"]["dir"])] = "python run.py -m (hydra.sweep.dir)"
    for script in sorted({*ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("experiments/*.py"),
                          *ROOT.glob("moe_lab/**/*.py")}):
        for default in re.findall(r"add_argument\(\s*\"--out(?:put)?(?:-dir)?\"[^)]*?default=\"([^\"]+)\"",
                                  script.read_text()):
            found[_first_part(default)] = f"{script.relative_to(ROOT)} --out"
    for script in sorted(ROOT.glob("scripts/*.sh")):
        for default in re.findall(r"\$\{OUT:-([^}]+)\}", script.read_text()):
            found[_first_part(default)] = f"{script.relative_to(ROOT)} $OUT"
    for doc in DOCS:
        for folder in re.findall(r"--out (\S+)", doc.read_text()):
            # a folder (a file name such as items.jsonl, or a placeholder such as <dir>, is the user's own)
            if not Path(folder).suffix and not folder.startswith("<"):
                found[_first_part(folder)] = f"--out in {doc.relative_to(ROOT)}"
    return found


def test_the_folders_are_found_where_they_are_defined():
    found = output_dirs()
    for folder in ("outputs", "multirun", "bench_offload", "gpu_checks_out", "table", "tables"):
        assert folder in found, (folder, found)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git clone")
def test_every_default_output_folder_is_git_ignored():
    found = output_dirs()
    probes = [f"{folder}/some_run/file.txt" for folder in found]
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(probes),
                          capture_output=True, text=True, check=False)
    ignored = {_first_part(line) for line in proc.stdout.splitlines()}
    missing = {folder: why for folder, why in found.items() if folder not in ignored}
    assert not missing, f"add these folders to .gitignore: {missing}"
