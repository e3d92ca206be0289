"""NeVA's `.nemo` archives as a model directory: the conversion `nemo_archive.unpack` calls (tokenizer,
chat template, stop ids, image processor written next to the unpacked archive) and the config reader
for the unpacked directory. Here, below models/, because resolving a model path (`resolve.py`) unpacks
archives before any model code is imported; the model itself is models/neva/."""
from __future__ import annotations

import json
import logging
import os

from splitserve.loading.nemo_archive import copy_hf_files, unpack

logger = logging.getLogger(__name__)

PATCH_TOKEN = "<extra_id_3>"  # NeMo's image patch token for NVGPT tokenizers: the placeholder
VIDEO_TOKEN_INDEX = -201      # marks a video in token-id prompts (as -200 marks a VILA image)
DEFAULT_NUM_FRAMES = 8

_NVGPT_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
_STEERLM_LABELS = ("<extra_id_2>quality:4,toxicity:0,humor:0,creativity:0,helpfulness:4,correctness:4,"
                   "coherence:4,complexity:4,verbosity:4\n")


def _nvgpt_template(after_assistant: str = "") -> str:
    # NeMo's SeparatorStyle.NVGPT: "<extra_id_0>System\n{system}<extra_id_1>User\n{msg}\n<extra_id_1>Assistant\n"
    return (
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set sys = messages[0]['content'] + '\\n\\n' -%}{%- else -%}"
        "{%- set sys = \"" + _NVGPT_SYSTEM + "\\n\\n\" -%}{%- endif -%}"
        "{{ '<extra_id_0>System\\n' + sys }}"
        "{%- for m in messages if m['role'] != 'system' -%}"
        "{%- if m['role'] == 'user' -%}{{ '<extra_id_1>User\\n' + m['content'] + '\\n' }}"
        "{%- elif m['role'] == 'assistant' -%}{{ '<extra_id_1>Assistant\\n" + after_assistant.replace("\n", "\\n")
        + "' + m['content'] + '\\n' }}"
        "{%- else -%}{{ raise_exception('roles must be system, user or assistant') }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<extra_id_1>Assistant\\n" + after_assistant.replace("\n", "\\n")
        + "' }}{%- endif -%}")


_VICUNA_TEMPLATE = (  # NeMo's SeparatorStyle.TWO with sep " ", sep2 "<extra_id_7>"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set sys = messages[0]['content'] -%}"
    "{%- else -%}{%- set sys = \"A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions.\" -%}{%- endif -%}"
    "{{ sys + ' ' }}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{%- if m['role'] == 'user' -%}{{ 'USER: ' + m['content'] + ' ' }}"
    "{%- else -%}{{ 'ASSISTANT: ' + m['content'] + '<extra_id_7>' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}")

_PLAIN_TEMPLATE = "{%- for m in messages if m['role'] != 'system' -%}{{ m['content'] + '\\n' }}{%- endfor -%}"

CONV_TEMPLATES = {
    "nvgpt": _nvgpt_template(),
    "nv_steerlm": _nvgpt_template(_STEERLM_LABELS),
    "v1": _VICUNA_TEMPLATE, "vicuna_v1": _VICUNA_TEMPLATE, "llava_v1": _VICUNA_TEMPLATE,
    "plain": _PLAIN_TEMPLATE,
}


# -- unpacking (called by nemo_archive.unpack) -----------------------------------------------------
def _resolve_tower_dir(name: str | None, nemo_dir: str) -> str | None:
    if not name:
        return None
    for candidate in (name, os.path.join(nemo_dir, name)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return os.path.abspath(candidate)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
            return snapshot_download(name, local_files_only=True)
        except Exception:
            return None
    return None


def _write_tokenizer(out: str, archive: str, tok_cfg: dict) -> str | None:
    """The archive's tokenizer as HF files in `out`; None (a warning) where transformers cannot read it."""
    def member(ref):
        if not isinstance(ref, str):
            return None
        name = os.path.basename(ref[len("nemo:"):] if ref.startswith("nemo:") else ref)
        for folder, dirs, files in os.walk(archive):
            if name in files or name in dirs:
                return os.path.join(folder, name)
        return None
    library = (tok_cfg or {}).get("library")
    if library == "huggingface":
        where = member(tok_cfg.get("type")) or member(tok_cfg.get("model"))
        folder = where if where and os.path.isdir(where) else os.path.dirname(where) if where else None
        if folder is None:  # the tokenizer files anywhere in the archive
            found = [f for f, _, files in os.walk(archive) if "tokenizer.json" in files or "tokenizer_config.json" in files]
            folder = found[0] if found else None
        if folder and copy_hf_files(folder, out, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                                  "tokenizer.model", "vocab.json", "merges.txt")):
            return "huggingface"
        return None
    if library == "sentencepiece":
        model = member(tok_cfg.get("model"))
        if model is None:
            return None
        import shutil
        shutil.copy(model, os.path.join(out, "tokenizer.model"))
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            # NeMo's sentencepiece tokenizer adds neither BOS nor EOS to a prompt, and a leading
            # space only where the model's normalizer adds its dummy prefix
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                       "legacy": False, "add_prefix_space": _spm_adds_dummy_prefix(model)}, f)
        try:
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(out).save_pretrained(out)
        except Exception as e:
            logger.warning("the .nemo's sentencepiece tokenizer could not be read by transformers (%s: %s); "
                           "pass --tokenizer DIR", type(e).__name__, e)
            return None
        return "sentencepiece"
    return None


def _spm_adds_dummy_prefix(path: str) -> bool:
    try:
        from sentencepiece import sentencepiece_model_pb2
        proto = sentencepiece_model_pb2.ModelProto()
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
        return bool(proto.normalizer_spec.add_dummy_prefix)
    except Exception:  # sentencepiece / protobuf missing: the conversion below says so
        return True


def _add_chat_template(out: str, conv: str | None) -> None:
    path = os.path.join(out, "tokenizer_config.json")
    if not os.path.isfile(path):
        return
    template = CONV_TEMPLATES.get(conv or "nvgpt")
    if template is None:
        logger.warning("NeVA conv_template %r has no chat template here (supported: %s); chat requests "
                       "need --chat-template or plain completions", conv, ", ".join(CONV_TEMPLATES))
        return
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    for name in ("chat_template.jinja", "chat_template.json"):  # a saved copy would take precedence
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))


def _write_stop_ids(out: str, conv: str | None) -> None:
    """generation_config.json's eos ids: the tokenizer's EOS and, for the NVGPT templates, the turn
    separator <extra_id_1> (NeMo stops generation on it)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if (conv or "nvgpt") in ("nvgpt", "nv_steerlm"):
        sep = tok.convert_tokens_to_ids("<extra_id_1>")
        if sep is not None and sep != tok.unk_token_id:
            ids.append(sep)
    if ids:
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": ids}, f)


def unpack_nemo(path: str) -> str:
    """The model directory of a .nemo archive (unpacked and converted once, into the cache)."""
    return unpack(path, write_model_files)


def write_model_files(out: str, archive: str, nemo_cfg: dict, nemo_dir: str) -> dict:
    """Tokenizer, image processor and the settings config.json records for load_neva_config."""
    mm = nemo_cfg.get("mm_cfg") or {}
    data = nemo_cfg.get("data") or {}
    enc = mm.get("vision_encoder") or {}
    tower = _resolve_tower_dir(enc.get("from_pretrained"), nemo_dir)
    tokenizer = _write_tokenizer(out, archive, nemo_cfg.get("tokenizer") or {})
    _add_chat_template(out, data.get("conv_template"))
    if tokenizer is not None:
        _write_stop_ids(out, data.get("conv_template"))
    if tower is not None and not copy_hf_files(tower, out, ("preprocessor_config.json",)):
        from transformers import CLIPImageProcessor, CLIPVisionConfig
        size = CLIPVisionConfig.from_pretrained(tower).image_size
        CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)
    return {"vision_tower_dir": tower, "vision_tower_name": enc.get("from_pretrained"), "tokenizer": tokenizer}


# -- config -------------------------------------------------------------------------------------------
_ACTIVATIONS = {"squared-relu": "relu2", "relu": "relu", "gelu": "gelu"}


def load_neva_config(directory: str):
    """A transformers NemotronConfig for the decoder, carrying the vision config and NeVA's settings."""
    import yaml
    from transformers import CLIPVisionConfig, NemotronConfig
    with open(os.path.join(directory, "config.json")) as f:
        info = json.load(f)
    cfg_path = next((os.path.join(d, "model_config.yaml") for d, _, files in os.walk(os.path.join(directory, "archive"))
                     if "model_config.yaml" in files), None)
    with open(cfg_path) as f:
        c = yaml.safe_load(f)
    mm, data = c.get("mm_cfg") or {}, c.get("data") or {}

    def refuse(field, value, why):
        raise ValueError(f"NeVA model_config.yaml {field}={value!r} is not supported ({why})")
    act = c.get("activation", "gelu")
    if act not in _ACTIVATIONS:
        refuse("activation", act, f"supported: {', '.join(_ACTIVATIONS)}; gated MLPs (swiglu/geglu) are not")
    norm = c.get("normalization", "layernorm")
    if norm not in ("layernorm1p", "layernorm"):
        refuse("normalization", norm, "layernorm1p and layernorm are")
    if c.get("position_embedding_type", "learned_absolute") != "rope":
        refuse("position_embedding_type", c.get("position_embedding_type"), "rotary (rope) is")
    if c.get("transformer_block_type", "pre_ln") != "pre_ln":
        refuse("transformer_block_type", c.get("transformer_block_type"), "pre_ln is")
    if c.get("seq_len_interpolation_factor") not in (None, 1, 1.0):
        refuse("seq_len_interpolation_factor", c.get("seq_len_interpolation_factor"), "no rope scaling")
    adapter = mm.get("mm_mlp_adapter_type", "linear")
    if adapter not in ("mlp2x_gelu", "linear"):
        refuse("mm_cfg.mm_mlp_adapter_type", adapter, "mlp2x_gelu and linear are")
    if mm.get("use_im_start_end"):
        refuse("mm_cfg.use_im_start_end", True, "the run without start/end tokens is")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    bias = bool(c.get("bias", True))
    config = NemotronConfig(
        vocab_size=info["vocab_size"], hidden_size=hidden, intermediate_size=c["ffn_hidden_size"],
        num_hidden_layers=c["num_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_query_groups") or heads, head_dim=c.get("kv_channels") or hidden // heads,
        hidden_act=_ACTIVATIONS[act], max_position_embeddings=c.get("max_position_embeddings") or c.get("encoder_seq_length"),
        norm_eps=c.get("layernorm_epsilon", 1e-5), attention_bias=bias, mlp_bias=bias,
        tie_word_embeddings=bool(c.get("share_embeddings_and_output_weights", True)),
        rope_parameters={"rope_type": "default", "rope_theta": float(c.get("rotary_base", 10000.0)),
                         "partial_rotary_factor": float(c.get("rotary_percentage", 1.0))},
        bos_token_id=None, eos_token_id=None)
    config.architectures = ["NevaForCausalLM"]
    tower = info.get("vision_tower_dir")
    if tower is not None and not os.path.isabs(tower):  # a hand-written directory (benchmark configs)
        tower = os.path.join(directory, tower)
    if tower is None:
        raise ValueError(f"NeVA's vision tower {info.get('vision_tower_name')!r} (mm_cfg.vision_encoder."
                         f"from_pretrained) was not found: give a local HF CLIP directory there (absolute, or "
                         f"relative to the .nemo file) or download it into the Hugging Face cache")
    vision = CLIPVisionConfig.from_pretrained(tower)
    if getattr(vision, "vision_config", None) is not None:
        vision = vision.vision_config
    config.vision_config = vision
    enc = mm.get("vision_encoder") or {}
    config.neva = {
        "norm": norm, "adapter": adapter, "vision_select_layer": enc.get("vision_select_layer", -2),
        "class_token_length": enc.get("class_token_length", 1), "vision_tower_dir": tower,
        "image_aspect_ratio": data.get("image_aspect_ratio", "square"), "weights": info["weights"],
        "num_frames": data.get("num_frames") or DEFAULT_NUM_FRAMES, "conv_template": data.get("conv_template"),
    }
    return config
