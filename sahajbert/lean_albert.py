"""LeanALBERT, sahajBERT-XL's model: ALBERT with pre-LayerNorm blocks, a GeGLU feed-forward and rotary attention.

The released sahajBERT-XL checkpoint is an ALBERT config (`model_type: "albert"`) that carries
`hidden_act_gated: true` and `position_embedding_type: "rotary"`, with weights under the names of the reference
implementation (tanmoyio/sahajBERT, `lib/models/lean_albert.py`). This module reads and writes that format. It
imports only torch and transformers, so that it can travel beside a checkpoint as transformers' custom model code.

The differences from transformers' ALBERT, each as the reference has it:
- every block normalizes its input (pre-LayerNorm) and adds its output to the un-normalized input; the encoder
  normalizes its last hidden state once more (`post_layer_norm`); the per-layer `full_layer_layer_norm` is kept
  in the weights but unused;
- the feed-forward input projection is twice the intermediate size, and gelu_new of its first half gates its
  second half (GeGLU, `hidden_act_gated`);
- queries and keys are rotated by their position (rotary, base `rotary_embedding_base`), and there is no
  position-embedding table; one Linear makes queries, keys and values (`dense_qkv`).
"""

import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import AlbertConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.models.albert.modeling_albert import AlbertForPreTrainingOutput, AlbertMLMHead, AlbertSOPHead

IGNORE_INDEX = -100
# Written into every saved config, with this file beside the weights: transformers' custom-code mechanism, so that
# `AutoModelFor...from_pretrained(folder, trust_remote_code=True)` loads a checkpoint without this project installed
AUTO_MAP = {
    "AutoConfig": "lean_albert.LeanAlbertConfig",
    "AutoModel": "lean_albert.LeanAlbertModel",
    "AutoModelForPreTraining": "lean_albert.LeanAlbertForPreTraining",
    "AutoModelForMaskedLM": "lean_albert.LeanAlbertForMaskedLM",
    "AutoModelForTokenClassification": "lean_albert.LeanAlbertForTokenClassification",
    "AutoModelForSequenceClassification": "lean_albert.LeanAlbertForSequenceClassification",
}


class LeanAlbertConfig(AlbertConfig):
    """ALBERT's fields plus the three that make it LeanALBERT; saved as `model_type: "albert"`, as released."""

    def __init__(
        self,
        hidden_act_gated: bool = False,
        position_embedding_type: str = "absolute",
        rotary_embedding_base: int = 10_000,
        **kwargs,
    ):
        super().__init__(position_embedding_type=position_embedding_type, **kwargs)
        self.hidden_act_gated = hidden_act_gated
        self.rotary_embedding_base = rotary_embedding_base
        if position_embedding_type not in ("absolute", "rotary"):
            raise ValueError(f"position_embedding_type must be 'absolute' or 'rotary', got {position_embedding_type}")


def is_lean_albert(config: dict) -> bool:
    """A released-format config is LeanALBERT by its fields, whatever its `architectures` say."""
    return bool(config.get("hidden_act_gated")) or config.get("position_embedding_type") == "rotary"


def rotary_tables(length: int, dim: int, base: float, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, [length, dim]: frequencies base^(-2i/dim), each used for both halves."""
    exponents = torch.arange(0, dim // 2, dtype=torch.float32, device=device) * (-2.0 / dim)
    frequencies = torch.pow(float(base), exponents).repeat(2)
    angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * frequencies[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i + dim/2}) of x [batch, length, heads, dim] by their position's angle."""
    left, right = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-right, left], dim=-1) * sin


class LeanAlbertEmbeddings(nn.Module):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.embedding_size)
            if config.position_embedding_type == "absolute"
            else None
        )
        self.layernorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None, inputs_embeds=None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if token_type_ids is None:
            token_type_ids = torch.zeros(embeddings.shape[:2], dtype=torch.long, device=embeddings.device)
        embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            positions = torch.arange(embeddings.shape[1], device=embeddings.device)
            embeddings = embeddings + self.position_embeddings(positions)[None]
        return self.dropout(self.layernorm(embeddings))


class LeanAlbertAttention(nn.Module):
    """Pre-LayerNorm self-attention with one qkv projection, rotary positions, and a residual connection."""

    def __init__(self, config: LeanAlbertConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        self.rotary_base = config.rotary_embedding_base if config.position_embedding_type == "rotary" else None
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dense_qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.output_dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, hidden = hidden_states.shape
        qkv = self.dense_qkv(self.layer_norm(hidden_states)).view(batch, length, 3, self.heads, self.head_size)
        query, key, value = qkv.unbind(dim=2)  # each [batch, length, heads, head_size]
        if self.rotary_base is not None:
            cos, sin = rotary_tables(length, self.head_size, self.rotary_base, query.dtype, query.device)
            query, key = rotate(query, cos[:, None], sin[:, None]), rotate(key, cos[:, None], sin[:, None])
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # [batch, heads, length, head_size]
        scores = torch.matmul(query, key.transpose(-1, -2)) / self.head_size**0.5
        if additive_mask is not None:
            scores = scores + additive_mask
        probabilities = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probabilities, value).transpose(1, 2).reshape(batch, length, hidden)
        return hidden_states + self.output_dropout(self.dense_out(context))


class LeanAlbertFeedForward(nn.Module):
    """Pre-LayerNorm feed-forward, GeGLU when gated, with a residual connection."""

    def __init__(self, config: LeanAlbertConfig):
        super().__init__()
        self.gated = config.hidden_act_gated
        inner = config.intermediate_size * (2 if self.gated else 1)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dense_i2h = nn.Linear(config.hidden_size, inner)
        self.dense_h2o = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        inner = self.dense_i2h(self.layer_norm(hidden_states))
        if self.gated:
            gate, linear = inner.chunk(2, dim=-1)
            inner = self.activation(gate) * linear
        else:
            inner = self.activation(inner)
        return hidden_states + self.dropout(self.dense_h2o(inner))


class LeanAlbertLayer(GradientCheckpointingLayer):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__()
        # in the reference's weights, never used by its forward: kept so that our files load there and back
        self.full_layer_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = LeanAlbertAttention(config)
        self.ffn = LeanAlbertFeedForward(config)

    def forward(self, hidden_states: torch.Tensor, additive_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.ffn(self.attention(hidden_states, additive_mask))


class LeanAlbertLayerGroup(nn.Module):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__()
        self.albert_layers = nn.ModuleList([LeanAlbertLayer(config) for _ in range(config.inner_group_num)])


class LeanAlbertTransformer(nn.Module):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__()
        self.config = config
        self.embedding_hidden_mapping_in = nn.Linear(config.embedding_size, config.hidden_size)
        self.albert_layer_groups = nn.ModuleList(
            [LeanAlbertLayerGroup(config) for _ in range(config.num_hidden_groups)]
        )
        self.post_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, embeddings: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        hidden_states = self.embedding_hidden_mapping_in(embeddings)
        config = self.config
        for index in range(config.num_hidden_layers):
            # ALBERT shares parameters: the layers are spread evenly over the groups, each group used in turn
            group = self.albert_layer_groups[index * config.num_hidden_groups // config.num_hidden_layers]
            for layer in group.albert_layers:
                hidden_states = layer(hidden_states, additive_mask)
        return self.post_layer_norm(hidden_states)


class LeanAlbertPreTrainedModel(PreTrainedModel):
    config_class = LeanAlbertConfig
    base_model_prefix = "albert"
    supports_gradient_checkpointing = True
    # the reference's weights: no position table under rotary (it never had one), nothing else optional
    _keys_to_ignore_on_load_unexpected = [r"position_ids"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, AlbertMLMHead):
            nn.init.zeros_(module.bias)

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """transformers' save, plus the model code and the auto_map that let transformers alone load it."""
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        shutil.copyfile(Path(__file__), Path(save_directory) / "lean_albert.py")


class LeanAlbertModel(LeanAlbertPreTrainedModel):
    def __init__(self, config: LeanAlbertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = LeanAlbertEmbeddings(config)
        self.encoder = LeanAlbertTransformer(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooling_layer else None
        self.pooler_activation = nn.Tanh() if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, **kwargs
    ) -> BaseModelOutputWithPooling:
        embeddings = self.embeddings(input_ids, token_type_ids, inputs_embeds)
        additive_mask = None
        if attention_mask is not None and attention_mask.dim() == 4:
            # already additive, (batch, 1, 1 or length, length), used as given, as transformers does (the XLA path
            # passes one, to keep the traced graph free of host round trips)
            additive_mask = attention_mask.to(embeddings.dtype)
        elif attention_mask is not None:
            # padded keys get the most negative number: softmax gives them zero weight (as the reference does)
            keep = attention_mask[:, None, None, :].to(embeddings.dtype)
            additive_mask = (1.0 - keep) * torch.finfo(embeddings.dtype).min
        sequence_output = self.encoder(embeddings, additive_mask)
        pooled = self.pooler_activation(self.pooler(sequence_output[:, 0])) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=sequence_output, pooler_output=pooled)


class _WithEmbeddingsTied:
    """The masked-LM decoder shares the word embeddings, as in ALBERT."""

    _tied_weights_keys = {
        "predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
        "predictions.decoder.bias": "predictions.bias",
    }

    def get_output_embeddings(self) -> nn.Linear:
        return self.predictions.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.predictions.decoder = new_embeddings


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


class LeanAlbertForPreTraining(_WithEmbeddingsTied, LeanAlbertPreTrainedModel):
    """Masked LM + sentence-order prediction, as ALBERT pretrains (and as sahajBERT-XL did)."""

    def __init__(self, config: LeanAlbertConfig):
        super().__init__(config)
        self.albert = LeanAlbertModel(config)
        self.predictions = AlbertMLMHead(config)
        self.sop_classifier = AlbertSOPHead(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        inputs_embeds=None,
        labels=None,
        sentence_order_label=None,
        **kwargs,
    ) -> AlbertForPreTrainingOutput:
        outputs = self.albert(input_ids, attention_mask, token_type_ids, inputs_embeds)
        prediction_logits = self.predictions(outputs.last_hidden_state)
        sop_logits = self.sop_classifier(outputs.pooler_output)
        loss = None
        if labels is not None and sentence_order_label is not None:
            loss = _cross_entropy(prediction_logits, labels) + _cross_entropy(sop_logits, sentence_order_label)
        return AlbertForPreTrainingOutput(loss=loss, prediction_logits=prediction_logits, sop_logits=sop_logits)


class LeanAlbertForMaskedLM(_WithEmbeddingsTied, LeanAlbertPreTrainedModel):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__(config)
        self.albert = LeanAlbertModel(config, add_pooling_layer=False)
        self.predictions = AlbertMLMHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None, **kw):
        outputs = self.albert(input_ids, attention_mask, token_type_ids, inputs_embeds)
        logits = self.predictions(outputs.last_hidden_state)
        return MaskedLMOutput(loss=None if labels is None else _cross_entropy(logits, labels), logits=logits)


class LeanAlbertForTokenClassification(LeanAlbertPreTrainedModel):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__(config)
        self.albert = LeanAlbertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout_prob
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None, **kw):
        outputs = self.albert(input_ids, attention_mask, token_type_ids, inputs_embeds)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        return TokenClassifierOutput(loss=None if labels is None else _cross_entropy(logits, labels), logits=logits)


class LeanAlbertForSequenceClassification(LeanAlbertPreTrainedModel):
    def __init__(self, config: LeanAlbertConfig):
        super().__init__(config)
        self.albert = LeanAlbertModel(config)
        self.dropout = nn.Dropout(config.classifier_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, labels=None, **kw):
        outputs = self.albert(input_ids, attention_mask, token_type_ids, inputs_embeds)
        logits = self.classifier(self.dropout(outputs.pooler_output))
        return SequenceClassifierOutput(loss=None if labels is None else _cross_entropy(logits, labels), logits=logits)
