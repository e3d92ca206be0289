"""model_type -> the HF architecture name a config without `architectures` (a GGUF file, a bare
text_config) stands for. Here, below models/, because reading a checkpoint's config needs it before
any model code runs; models/families.py keys its decoder families by the same model types."""

ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "granite": "GraniteForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM", "opt": "OPTForCausalLM", "persimmon": "PersimmonForCausalLM",
    "stablelm": "StableLmForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "kosmos_2_text_model": "Kosmos2TextForCausalLM",  # Kosmos-2's language model, alone
    "mbart": "MBartForCausalLM",  # mBART's decoder alone (with cross-attention: Nougat's, models/nougat/model.py)
}
