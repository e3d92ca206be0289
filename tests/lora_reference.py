"""PEFT as the independent reference for LoRA: adapters made by peft on a base model (random,
non-zero A and B), saved with save_pretrained, and the base model with one adapter merged in."""
from __future__ import annotations

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_model, out_dir, *, rank: int, alpha: float, seed: int, targets=None,
                      use_rslora: bool = False, magnitude: float = 0.05, **extra) -> str:
    """Wraps base_model (a transformers model, left unchanged) with a fresh LoRA adapter whose A and B
    are drawn from a seeded generator, saves it to out_dir and returns the path."""
    import copy

    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_PROJECTIONS, lora_dropout=0.0,
                     use_rslora=use_rslora, init_lora_weights=False, **extra)
    peft_model = get_peft_model(copy.deepcopy(base_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * magnitude)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def merged_reference(base_model, adapter_dir):
    """A copy of base_model with the adapter merged into its weights (peft's merge_and_unload)."""
    import copy

    from peft import PeftModel
    model = PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir)
    return model.merge_and_unload().eval()
