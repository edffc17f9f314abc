"""Small real transformers architectures with random weights, saved as safetensors checkpoints."""

from __future__ import annotations

from pathlib import Path


def _configs():
    """Each kind's config, built when asked for (transformers imported once)."""
    import transformers

    return {**_small_configs(transformers), **_sized_configs(transformers), **_other_configs(transformers)}


def _small_configs(transformers):
    """A few hundred KB each: decoders and encoders of the common architectures."""
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    encoder = dict(common, max_position_embeddings=128)
    return {
        "llama": lambda: transformers.LlamaConfig(**common, num_key_value_heads=2, architectures=["LlamaForCausalLM"]),
        "qwen2": lambda: transformers.Qwen2Config(**common, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=512,
            n_embd=128,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
            architectures=["GPT2LMHeadModel"],
        ),
        "gemma": lambda: transformers.GemmaConfig(
            **common, num_key_value_heads=1, head_dim=32, architectures=["GemmaForCausalLM"]
        ),
        "mixtral": lambda: transformers.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]
        ),
        "bert": lambda: transformers.BertConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            architectures=["BertModel"],
        ),
        # Odd sizes: the bytes the checkpoint lacks (rotary inv_freq) do not fit the arena's page rounding.
        "llama-odd": lambda: transformers.LlamaConfig(
            vocab_size=133,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            architectures=["LlamaForCausalLM"],
        ),
        "roberta": lambda: transformers.RobertaConfig(**encoder, architectures=["RobertaModel"]),
        "xlm-roberta": lambda: transformers.XLMRobertaConfig(**encoder, architectures=["XLMRobertaModel"]),
        "distilbert": lambda: transformers.DistilBertConfig(
            vocab_size=512, dim=128, hidden_dim=256, n_layers=2, n_heads=4, architectures=["DistilBertModel"]
        ),
        "electra": lambda: transformers.ElectraConfig(**encoder, embedding_size=64, architectures=["ElectraModel"]),
    }


def _sized_configs(transformers):
    """Realistic sizes (the CPU tests'), and the GPU tests' Llamas."""
    return {
        # Realistic sizes, where page rounding no longer hides a size bug: BERT-base (438 MB fp32) and a 499 MB Llama.
        "bert-base": lambda: transformers.BertConfig(architectures=["BertModel"]),
        "llama-500m": lambda: transformers.LlamaConfig(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            architectures=["LlamaForCausalLM"],
        ),
        # The GPU tests' Llamas: 72 MiB in bf16 for the node fills, 161 MiB where GPU memory figures must mean something.
        "llama-gpu-small": lambda: transformers.LlamaConfig(
            vocab_size=8192,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=4,
            num_attention_heads=12,
            num_key_value_heads=4,
            architectures=["LlamaForCausalLM"],
        ),
        "llama-gpu": lambda: transformers.LlamaConfig(
            vocab_size=8192,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=6,
            num_attention_heads=16,
            num_key_value_heads=4,
            architectures=["LlamaForCausalLM"],
        ),
    }


def _other_configs(transformers):
    """Other modalities, a state-space model, encoder-decoders."""
    return {
        # Other modalities: speech (features in, tokens out) and vision (pixels in).
        "whisper": lambda: transformers.WhisperConfig(
            vocab_size=512,
            num_mel_bins=16,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_source_positions=32,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            architectures=["WhisperForConditionalGeneration"],
        ),
        "vit": lambda: transformers.ViTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
            architectures=["ViTModel"],
        ),
        # A state-space model: no attention, selective-scan mixers.
        "mamba": lambda: transformers.MambaConfig(
            vocab_size=512, hidden_size=64, state_size=8, num_hidden_layers=2, architectures=["MambaForCausalLM"]
        ),
        # Encoder-decoders: their forward needs decoder inputs as well.
        "t5": lambda: transformers.T5Config(
            vocab_size=512,
            d_model=128,
            d_kv=32,
            d_ff=256,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            architectures=["T5ForConditionalGeneration"],
        ),
        "bart": lambda: transformers.BartConfig(
            vocab_size=512,
            d_model=128,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            max_position_embeddings=128,
            architectures=["BartForConditionalGeneration"],
        ),
    }


ARCHITECTURES = ("llama", "qwen2", "gpt2", "gemma", "mixtral", "bert")
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra")
LARGE = ("bert-base", "llama-500m")


def save_random_model(
    kind: str, directory: Path, dtype: str = "float32", seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """Build ``kind`` from its config with seeded random weights and save it (safetensors) in ``directory``."""
    import torch
    import transformers

    config = _configs()[kind]()
    torch.manual_seed(seed)
    cls = getattr(transformers, config.architectures[0])
    model = _fast_random(cls, config, seed) if kind in LARGE else cls(config)
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return Path(directory)


def _fast_random(cls, config, seed: int):
    """``cls(config)`` without transformers' weight initialisation, every parameter then drawn from N(0, 0.02) (seeded).

    About 1 s instead of 3 s for a few hundred MB; buffers are computed by the model as usual.
    """
    import torch
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = cls(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model
