"""Models: the embedded presets, and loading any Hugging Face causal-LM directory or align artifact.

`--model` accepts
  * a preset name (`tiny`, `small`): a fresh random-init Llama with the tokenizer shipped in data/tokenizer,
  * an align artifact directory (has artifact.json; the model is its `model/`; checked complete and untampered),
  * a `save_pretrained` directory (config.json + weights + tokenizer),
  * a Hugging Face hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`): from the local cache, else downloaded (config,
    safetensors, tokenizer files only); offline and not cached, an error says how to pass a directory instead.
Weights load from safetensors only; `trust_remote_code` is off unless the user passes it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from align.errors import UserError
from align.paths import TOKENIZER_DIR

REWARD_HEAD_KEY = "align_reward_head"  # a reward model's config names its head (align.reward_model)
REWARD_HEADS = ("scalar", "likelihood")  # the heads a reward model may have (align.reward_model)

PRESETS = {
    # ~0.5M parameters: 2 layers x d128 with RoPE learns the arithmetic task in minutes on 2 CPU cores.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=384, max_position_embeddings=512),
    # ~63M parameters: for a GPU.
    "small": dict(hidden_size=768, num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, max_position_embeddings=1024),
}


def preset_architecture(spec: str) -> str | None:
    """The preset `spec` (a --model value) is, or whose architecture its config.json has: a model align built from
    scratch (`align model init`, a stage's output on one, a preset saved with save_pretrained). None for any other
    model (a pretrained one), a hub id, and what cannot be read here (loading it says why). Reads config.json only."""
    if spec in PRESETS and not Path(spec).exists():
        return spec
    path = Path(spec)
    config = path / "model" / "config.json" if (path / "artifact.json").is_file() else path / "config.json"
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(values, dict) or values.get("model_type") != "llama":
        return None
    return next((name for name, arch in PRESETS.items() if all(values.get(k) == v for k, v in arch.items())), None)


@dataclass
class ModelSource:
    """Where a model comes from: a preset (built fresh) or a directory (artifact or plain)."""

    spec: str
    model_dir: Path | None  # None for presets
    artifact: dict | None = None
    preset: str | None = None
    base: ModelSource | None = None  # a LoRA adapter saved alone (--no-merge): the model it is merged into

    @property
    def adapter_dir(self) -> Path | None:
        from align.lora import ADAPTER_DIR

        return self.model_dir / ADAPTER_DIR if self.base is not None else None

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_dir if self.model_dir is not None else TOKENIZER_DIR

    @property
    def config(self) -> dict:
        """The model's config.json ({} for a preset)."""
        if self.model_dir is None:
            return {}
        import json

        path = self.model_dir / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not a JSON model config ({e}); copy or save the model again.") from None
        if not isinstance(config, dict):
            raise UserError(f"{path}: not a JSON model config (an object); copy or save the model again.")
        return config

    @property
    def kind(self) -> str:
        """'policy' (causal LM) or 'reward' (a sequence classifier, or a causal LM whose config names a reward
        head), from the artifact or config."""
        if self.artifact and self.artifact.get("model_kind"):
            return self.artifact["model_kind"]
        if self.model_dir is not None:
            config = self.config
            arch = config.get("architectures") or [""]
            return "reward" if arch[0].endswith("ForSequenceClassification") or config.get(REWARD_HEAD_KEY) else "policy"
        return "policy"


def resolve(spec: str, expect: str | None = "policy") -> ModelSource:
    """Turn a --model value into a ModelSource, or a UserError that says what is wrong with it."""
    from align.artifacts import ARTIFACT_FILE, MODEL_DIR, verify_artifact

    if spec in PRESETS and not Path(spec).exists():
        return ModelSource(spec, None, preset=spec)
    path = Path(spec)
    if not path.exists() and HUB_ID.fullmatch(spec):
        path = hub_snapshot(spec)
    if not path.exists():
        raise UserError(
            f"{spec}: no such model directory or artifact. Use a preset ({', '.join(PRESETS)}), "
            "a save_pretrained directory, or a stage's --out directory."
        )
    if (path / ARTIFACT_FILE).is_file():
        art = verify_artifact(path)
        model_dir = path / MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise UserError(f"{path}: this {art.get('stage')} artifact holds no model (no {MODEL_DIR}/config.json).")
        source = ModelSource(spec, model_dir, artifact=art)
        from align.lora import is_adapter_only

        if is_adapter_only(model_dir):
            source.base = adapter_base(path, art)
    elif (path / "config.json").is_file():
        source = ModelSource(spec, path)
    else:
        raise UserError(f"{path}: neither an align artifact (artifact.json) nor a model directory (config.json).")
    if expect and source.kind != expect:
        want = "a policy (causal LM, e.g. an sft artifact)" if expect == "policy" else "a reward model (rm artifact)"
        raise UserError(f"{spec}: this is a {source.kind} model, but {want} is expected here.")
    if source.model_dir is not None and source.base is None and not any(source.model_dir.glob("*.safetensors")):
        raise UserError(f"{source.model_dir}: no .safetensors weights (align loads safetensors only, never pickles).")
    if source.model_dir is not None:
        check_weights(source.model_dir)
    return source


def check_weights(model_dir: Path) -> None:
    """Every safetensors file below `model_dir` has a readable header that covers the file (a truncated or
    foreign file is refused here, before any --out is touched, not while the model loads)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(model_dir.rglob("*.safetensors")):
        try:
            with safe_open(f, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise UserError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]}); it is truncated or "
                            "damaged: copy or save the model again.") from None


def adapter_base(path: Path, art: dict) -> ModelSource:
    """The base model of an artifact that holds a LoRA adapter alone (--no-merge): the run's input model, found
    where the run recorded it and checked unchanged since (artifact digest or file hashes)."""
    from align.artifacts import artifact_digest, hash_tree

    rec = art.get("inputs", {}).get("model", {})
    where = rec.get("artifact") or rec.get("dir") or rec.get("spec", "")
    what = f"{path}: holds a LoRA adapter without its merged model (--no-merge); its base model {where}"
    if not ("artifact" in rec or "dir" in rec):  # a preset's random init: refused at training time (config.py)
        raise UserError(f"{what} is not a saved model; retrain with --merge.")
    if not Path(where).exists():
        raise UserError(f"{what} is gone. Put it back there, or retrain with --merge.")
    changed = (artifact_digest(Path(where)) != rec.get("sha256") if "artifact" in rec
               else hash_tree(Path(where)) != rec.get("files"))
    if changed:
        raise UserError(f"{what} has changed since the adapter was trained on it; merging would give another "
                        "model. Restore it, or retrain with --merge.")
    return resolve(where, expect=None)


LOAD_ERRORS = (ValueError, OSError)  # from_pretrained on a directory it cannot read (the weights' headers are
# checked earlier, in resolve)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def hub_snapshot(repo_id: str) -> Path:
    """A hub model's local directory: the cached snapshot, else a download of its config, safetensors and
    tokenizer files (never pickled weights)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise UserError(f"{repo_id}: no such directory, and huggingface_hub is missing to fetch it as a hub id.") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated: all say the same useful thing
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{repo_id}: no such local directory, and not in the local Hugging Face cache nor downloadable from "
            f"here ({reason}). Pass --model DIR, a save_pretrained directory or a stage's --out (or a preset: "
            f"{', '.join(PRESETS)}; in a pipeline: --set stages.NAME.model=DIR); to use the hub model, run `hf "
            f"download {repo_id}` where the hub is reachable and copy ~/.cache/huggingface here."
        ) from None


# the files a tokenizer is loaded from (one of them): a fast tokenizer's, a SentencePiece model, BPE / WordPiece vocabularies
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False, chat_template: str = ""):
    """`source`'s tokenizer; `chat_template` (--chat-template FILE): its chat template, in place of its own (what
    the stage's saved model keeps)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source.tokenizer_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise tokenizer_error(source.tokenizer_dir, e) from None
    if chat_template:
        from align.chat import read_template

        tok.chat_template = read_template(chat_template)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token is None:
        raise UserError(f"{source.tokenizer_dir}: tokenizer has no EOS token; set eos_token in tokenizer_config.json.")
    from align import vision

    if vision.is_vlm_config(source.config):  # its image processor rides with it (align.vision)
        vision.attach_processor(tok, source.tokenizer_dir)
    vocab = source.config.get("vocab_size", source.config.get("text_config", {}).get("vocab_size"))
    if isinstance(vocab, int) and len(tok) > vocab:
        raise vocabulary_error(source.model_dir, len(tok), vocab)
    return tok


def tokenizer_error(directory: Path, e: Exception) -> UserError:
    """Why no tokenizer loads from `directory`: its files are missing (the usual case: a model saved without
    `tokenizer.save_pretrained`), or transformers' own reason."""
    if directory.is_dir() and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return UserError(f"{directory}: no tokenizer files (expected tokenizer.json, or tokenizer.model / vocab.json + "
                         "merges.txt with tokenizer_config.json); save the tokenizer beside the model "
                         f"(tokenizer.save_pretrained('{directory}')) or copy its files there.")
    return UserError(f"{directory}: cannot load a tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__}).")


def vocabulary_error(model_dir, tokens: int, vocab: int) -> UserError:
    return UserError(f"{model_dir}: the tokenizer has {tokens} tokens but the model's vocabulary is {vocab}; token "
                     "ids past it would index outside the embedding. Use the tokenizer the model was trained with "
                     "(tokenizer_class in tokenizer_config.json).")


def preset_config(name: str, tokenizer):
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}.")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **PRESETS[name],
    )


def model_class(config: dict):
    """The Auto class a model loads with: AutoModelForImageTextToText for a vision-language model
    (align.vision), else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from align.vision import is_vlm_config

    return AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM


def skeleton(source: ModelSource, trust_remote_code: bool = False):
    """`source`'s causal LM without weights (on the meta device: no memory, no file read but config.json), for
    checks of its modules before anything is loaded or written."""
    import torch
    from transformers import AutoConfig, LlamaConfig

    try:
        config = (LlamaConfig(**PRESETS[source.preset]) if source.preset else
                  AutoConfig.from_pretrained(source.model_dir, trust_remote_code=trust_remote_code))
        with torch.device("meta"):
            return model_class(source.config).from_config(config, trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"{source.model_dir}: cannot load as a causal LM ({str(e).splitlines()[0]}).") from None


def load_causal_lm(source: ModelSource, tokenizer, dtype, seed: int = 0, trust_remote_code: bool = False):
    """Build or load the policy (under a live ZeRO-3 link, see engine.build.load_partitioned, straight into
    shards)."""
    import torch
    from transformers import AutoModelForCausalLM

    if source.preset:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(preset_config(source.preset, tokenizer), dtype=dtype)
    if source.base is not None:
        return with_saved_adapter(load_causal_lm(source.base, tokenizer, dtype, seed, trust_remote_code),
                                  source)
    try:
        model = model_class(source.config).from_pretrained(
            source.model_dir, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except LOAD_ERRORS as e:
        raise UserError(f"{source.model_dir}: cannot load as a causal LM ({str(e).splitlines()[0]}).") from None
    vocab = model.config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise vocabulary_error(source.model_dir, len(tokenizer), vocab)
    return model


def with_saved_adapter(model, source: ModelSource):
    """`model` (loaded from `source.base`) with `source`'s saved LoRA adapter merged in and align's own config
    keys (a reward model's head and normalisation) taken from `source`'s config."""
    from align.lora import merge_saved_adapter

    merge_saved_adapter(model, source.adapter_dir)
    for k, v in source.config.items():
        if k.startswith("align_") or k == "pad_token_id":
            setattr(model.config, k, v)
    return model


DROPOUT_ATTRS = ("attention_dropout", "hidden_dropout", "dropout", "attn_dropout", "resid_dropout")  # rates kept
# as module attributes (transformers' attention modules pass attention_dropout to SDPA while training)


def uses_dropout(module) -> bool:
    """Whether a training forward of `module` draws random numbers: a dropout module with p > 0, or a dropout rate
    > 0 kept as an attribute (DROPOUT_ATTRS, what disable_dropout zeroes)."""
    import torch

    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(isinstance(getattr(m, a, None), float) and getattr(m, a) > 0 for a in DROPOUT_ATTRS):
            return True
    return False


def disable_dropout(model):
    """Dropout off in every module (every nn.Dropout and the attention / hidden dropout rates models keep as
    attributes), as TRL does by default for RL and preference training: two passes over the same tokens with
    the same weights then give the same log-probs, so PPO's and GRPO's ratio π_θ/π_old starts at exactly 1 and
    a reference's log-probs are not noise. Returns the model."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in DROPOUT_ATTRS:
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                "summary_first_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)
    return model


def context_length(config) -> int | None:
    """The positions a model can attend over (max_position_embeddings, or GPT-2's n_positions), if it says.
    `config`: a model config, or a ModelSource (read from its config.json or preset)."""
    if isinstance(config, ModelSource):
        if config.preset:
            return PRESETS[config.preset]["max_position_embeddings"]
        config = config.config
    text = config.get("text_config") if isinstance(config, dict) else getattr(config, "text_config", None)
    if text is not None:  # a multimodal model: its language model's positions
        config = text
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        if isinstance(get(key), int):
            return get(key)
    return None


def check_length(source: ModelSource, length: int, flag: str = "--max-length") -> None:
    """A UserError when `length` tokens would run past the model's positions."""
    context = context_length(source)
    if context is not None and length > context:
        raise UserError(f"{flag} {length} is longer than {source.spec}'s context ({context} positions); use "
                        f"{flag} {context} or less.")


def count_parameters(model) -> int:
    """Parameter count that also works on ZeRO-3 partitioned models (ds_numel is the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


AUTOCAST_ATTR = "_align_autocast_dtype"


def mark_autocast(model: torch.nn.Module, cfg: dict) -> None:
    """Under --precision bf16-mixed, note the autocast dtype on the module: DeepSpeed's forward applies it, and
    generation (which runs the bare module, outside the engine's forward) reads it with `autocast_dtype`."""
    import torch

    if cfg.get("torch_autocast", {}).get("enabled"):
        object.__setattr__(model, AUTOCAST_ATTR, torch.bfloat16)  # a plain attribute, not a submodule


def autocast_dtype(module: torch.nn.Module) -> torch.dtype | None:
    return getattr(module, AUTOCAST_ATTR, None)
