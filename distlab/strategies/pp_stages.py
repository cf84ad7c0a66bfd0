"""A pipeline stage of a Hugging Face decoder (strategies/pp.py): which layers each rank
holds, the model pruned to them with pass-throughs for the rest, and the bubble formula."""
from __future__ import annotations

from torch import nn


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous runs of layers, sizes differing by at most one (earlier stages get more)."""
    if n_stages > n_layers:
        raise ValueError(f"a pipeline of {n_stages} stages needs at least {n_stages} decoder layers; "
                         f"the model has {n_layers}")
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


def bubble_formula(stages: int, microbatches: int) -> float:
    """GPipe / 1F1B idle fraction with equal stage times (Huang et al. 2019; Narayanan et al. 2021)."""
    return (stages - 1) / (microbatches + stages - 1)


class PassThrough(nn.Module):
    """Stands in for a decoder layer another stage holds: the list keeps its length, so the
    model's forward still sees layer i at index i (per-layer attention types are indexed)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class StageModule(nn.Module):
    """This rank's slice of a Hugging Face causal LM, run through the model's own forward.

    Every stage calls the base model's forward (the full causal LM's on the last stage, so the
    head and any logit soft-capping are the model's own): the masks it builds (causal, sliding
    window, per-layer types), its rotary embeddings and its final norm are exactly those of the
    plain model. Layers of other stages are PassThrough. A later stage passes the activations it
    received as `inputs_embeds` (only their shape, dtype and device shape the masks and rotary
    tables) and a pre-hook on its first own layer hands them to that layer unchanged, so
    whatever the preamble does to embeddings (scaling, dropout) happens once, on stage 0.
    """

    def __init__(self, model, first_layer: nn.Module, first: bool, last: bool):
        super().__init__()
        self.hf = model
        self.first, self.last = first, last
        self._incoming = None
        if not first:
            first_layer.register_forward_pre_hook(self._hand_over, with_kwargs=True)

    def _hand_over(self, _module, args, kwargs):
        if args:
            return (self._incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._incoming}

    def forward(self, x):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        self._incoming = None if self.first else x
        if self.last:
            return self.hf(**inputs, use_cache=False).logits
        return self.hf.base_model(**inputs, use_cache=False).last_hidden_state


def prune_to_stage(model, keep: range, first: bool, last: bool) -> nn.Module:
    """Drop what other stages own, keeping Hugging Face parameter names for what stays; returns
    this stage's first decoder layer. What runs before and after the layers comes from the
    model's own pipeline plan (config.base_model_pp_plan, see distlab.configuration.families)."""
    from distlab.configuration.families import pp_pieces

    if model.config.tie_word_embeddings and not (first and last):
        raise NotImplementedError("pipeline parallel with tied input/output embeddings would put one weight on "
                                  "two stages; use a model with tie_word_embeddings false")
    pieces = pp_pieces(model.config)
    if pieces is None:
        raise NotImplementedError(f"pipeline parallel: {type(model).__name__} declares no base_model_pp_plan")
    before, layers_name, after = pieces
    base = model.base_model
    layers = getattr(base, layers_name)
    for index in range(len(layers)):
        if index not in keep:
            layers[index] = PassThrough()
    if not first:
        embed = model.get_input_embeddings()
        for name in before:
            child = getattr(base, name)
            if child is embed:
                setattr(base, name, None)  # never called: later stages pass inputs_embeds
            elif any(True for _ in child.parameters()):
                raise NotImplementedError(f"pipeline parallel: '{name}' of {type(base).__name__} has weights and "
                                          "runs before the decoder layers; only the first stage could hold it")
    if not last:
        for name in after:
            setattr(base, name, nn.Identity())  # the final norm belongs to the last stage
        head = model.get_output_embeddings()
        for name, child in model.named_children():
            if child is head:
                setattr(model, name, None)
    return layers[keep.start]
