"""Shared by tests/lora: tiny PEFT adapters made with ``peft`` itself, and the
transformers + peft greedy oracle."""

from __future__ import annotations

import os
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> (peft LoraConfig keywords, seed): different ranks, targets and scalings (rsLoRA too).
ADAPTERS = {
    "all-r8": (dict(r=8, lora_alpha=16, target_modules=ALL_MODULES), 1),
    "qv-r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 2),
    "mlp-rs": (dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj",
                                                                        "o_proj"]), 3),
}


_HF_BASE: dict = {}


def _hf_base(base_path):
    """transformers' model of ``base_path`` (loaded once; adapters are injected and removed again)."""
    from transformers import AutoModelForCausalLM

    key = str(base_path)
    if key not in _HF_BASE:
        _HF_BASE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32, attn_implementation="eager",
                                                             local_files_only=True).eval()
    return _HF_BASE[key]


def make_peft_adapter(base_path, out_dir, *, seed: int, scale: float = 0.5, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter for ``base_path`` at ``out_dir``: peft's own random init
    (``init_lora_weights=False``: B non-zero), scaled so each adapter changes greedy outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(_hf_base(base_path), LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    model.save_pretrained(str(out_dir))
    _HF_BASE[str(base_path)] = model.unload()  # the base model again, without the adapter's layers
    return Path(out_dir)


@torch.no_grad()
def peft_greedy(base_path, adapter_path, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers (+ peft when ``adapter_path``) greedy continuation of each prompt, one at a time."""
    from peft import PeftModel

    model = _hf_base(base_path)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, str(adapter_path)).eval()
    try:
        outs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
        return outs
    finally:
        if adapter_path is not None:
            _HF_BASE[str(base_path)] = model.unload()


def random_prompts(lengths, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """Token-id prompts (BOS first), avoiding the special ids 0..2 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab_size, (n - 1,), generator=gen).tolist() for n in lengths]


def write_adapter_files(folder, config: dict, tensors: dict) -> Path:
    """A hand-made adapter folder (for refusals)."""
    import json

    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    return Path(folder)
