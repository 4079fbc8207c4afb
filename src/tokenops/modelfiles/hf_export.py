"""Write a bundled GGUF model out as a Hugging Face folder (config, float32 safetensors, tokenizer).

vLLM and SGLang read HF folders, not our bundled GGUF files: this gives them the same weights and the
same tokenizer (chat template included), so a vLLM replica and our engine serve one model. transformers'
GGUF loader dequantises the weights; the folder is saved without the GGUF quantizer attached, or
transformers would write a config that asks for a GGUF file again.

Run:  python -m tokenops.modelfiles.hf_export [--model smollm2-135m-instruct] OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tokenops.modelfiles.bundled import DEFAULT_MODEL, resolve_bundled


def export_hf_folder(model: str, out: Path, cache_dir: Path | None = None) -> Path:
    """Write `model` (a bundled name or a .gguf path) as an HF folder at `out`; a complete folder is kept."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    gguf = Path(model) if model.endswith(".gguf") else resolve_bundled(model, cache_dir or Path(".cache"))
    kw = {"gguf_file": gguf.name}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    # written beside the target and renamed at the end: a half-written folder is never taken as done
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    hf.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a bundled model name or a .gguf path")
    args = ap.parse_args()
    print(export_hf_folder(args.model, args.out))


if __name__ == "__main__":
    main()
