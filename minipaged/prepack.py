"""Prepacking: the model's matmuls as vLLM's CPU build runs them, switched on by ``prepack(model)``.

On a CPU a decode step is mostly matmuls of a few rows (one per sequence) against big weights:
reading the weights is the cost. Two things make that read cheaper, both done once, when the model
is loaded, and both what vLLM does on a CPU:

- **Fused projections.** Q, K and V are three matmuls of the same input, gate and up two. Their
  weights stacked into one (``[q; k; v]``) make one matmul, whose output is split again: one call and
  one pass over the input instead of three. vLLM's models are written that way
  (``vllm/model_executor/models/llama.py``: ``qkv_proj`` is one ``QKVParallelLinear``, ``gate_up_proj``
  one ``MergedColumnParallelLinear``, and ``load_weights`` stacks the checkpoint's weights into them).
- **Prepacked weights.** oneDNN, PyTorch's CPU kernel library, reorders a weight into the blocked
  layout its matmul reads fastest (``torch.ops.mkldnn._reorder_linear_weight``), once, and each call
  here then runs ``torch.ops.mkldnn._linear_pointwise`` on it. vLLM's CPU build prepares a oneDNN
  matmul per linear layer after loading, with a binding of its own
  (``vllm/model_executor/layers/utils.py``, ``dispatch_cpu_unquantized_gemm``, which stacks nothing).
  ``torch.nn.functional.linear`` reorders nothing and, for a float32 weight, was measured about 3 times
  slower on a decode step's shapes.

:func:`prepack` changes the model in place and keeps everything else as it was: the parameters
and their Hugging Face names (``state_dict``, :func:`~minipaged.checkpoint.save_pretrained`), the
tied LM head, the contiguous and the paged forward. The packed copies sit beside the weights (the
weights' memory once more) and are rebuilt when a weight changes (a ``load_state_dict``, an
optimiser step, ``model.to``). Where oneDNN cannot run a weight (not float32, not on the CPU, a
PyTorch without it), the stacked weight goes through ``torch.nn.functional.linear``.
:func:`unpack` switches it all off again, so the plain model can run beside the packed one.

The packed matmul sums in another order than the plain one, so logits move in the last bits (about
1e-4 in float32 on SmolLM2's shapes): greedy tokens are the same except at a near-tie
(:mod:`minipaged.near_ties`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minipaged.model import LlamaForCausalLM


def _packable(weight: torch.Tensor) -> bool:
    """Can oneDNN's prepacked matmul run this weight (float32, on the CPU, oneDNN built in)?"""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()


class PackedLinear:
    """Bias-free linear layers of one input as one matmul on their weights, stacked and prepacked.

    Args:
        weights: the layers' weights, each ``[out_features_i, in_features]``, referred to (the
            module that holds them keeps them in its state dict; this is no module).

    Called on ``x: [..., in_features]`` it returns the layers' outputs: a tuple of one tensor per
    weight, or the tensor itself for one weight.
    """

    def __init__(self, weights: list[torch.Tensor]):
        self.weights, self.sizes, self._key = list(weights), [w.shape[0] for w in weights], None

    def _weights_key(self) -> list:
        """What identifies the weights' values: a new tensor (``model.to``) or an in-place change moves it."""
        return [(w.data_ptr(), w._version, w.dtype, w.device) for w in self.weights]

    def _pack(self) -> None:
        stacked = torch.cat([w.detach() for w in self.weights])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(stacked) if _packable(stacked) else stacked
        self._key = self._weights_key()

    def __call__(self, x: torch.Tensor):
        if self._key != self._weights_key():  # packed once, and again only after a weight changed
            self._pack()
        if self.packed.is_mkldnn:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        else:
            y = F.linear(x, self.packed)
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else y


# What prepack sets on each module: the attribute, which shadows the method of the same name, and its weights.
def _targets(model: LlamaForCausalLM):
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a LlamaForCausalLM, got {type(model).__name__}")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield attn, "qkv", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        yield attn.o_proj, "forward", [attn.o_proj.weight]
        yield mlp, "gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight]
        yield mlp.down_proj, "forward", [mlp.down_proj.weight]
    yield model.lm_head, "forward", [model.lm_head.weight]


def prepack(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Run ``model``'s matmuls fused and prepacked (see the module's docstring); returns ``model``, changed in place.

    Each decoder layer's Q/K/V projections (``LlamaAttention.qkv``) and gate/up projections
    (``LlamaMLP.gate_up``) become one :class:`PackedLinear` each, and the O, down and LM-head
    layers' ``forward`` a prepacked one: an instance attribute that shadows the method of the
    same name, which :func:`unpack` deletes again. Packing again an already packed model is a no-op.

    Raises:
        TypeError: ``model`` is not a :class:`~minipaged.model.LlamaForCausalLM`.
    """
    for module, name, weights in _targets(model):
        if not isinstance(module.__dict__.get(name), PackedLinear):
            setattr(module, name, PackedLinear(weights))
    return model


def unpack(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Undo :func:`prepack`: ``model`` runs its plain matmuls again (a plain model is left as it is); returns it.

    Raises:
        TypeError: ``model`` is not a :class:`~minipaged.model.LlamaForCausalLM`.
    """
    for module, name, _ in _targets(model):
        module.__dict__.pop(name, None)
    return model


def is_prepacked(model: LlamaForCausalLM) -> bool:
    """Does ``model`` run prepacked (:func:`prepack`)?"""
    return any(isinstance(module.__dict__.get(name), PackedLinear) for module, name, _ in _targets(model))
