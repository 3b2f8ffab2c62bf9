"""Where a Transformers causal LM keeps its blocks, found through the model's own metadata.

Every Transformers model class names the modules that must stay whole on one device in
``_no_split_modules``: its decoder layer (``GPT2Block``, ``GPTNeoXLayer``,
``OPTDecoderLayer``, ``LlamaDecoderLayer``...). ``device_map="auto"`` keeps them whole, and
Accelerate's FSDP auto-wrap wraps each instance of them. Here the blocks, the FSDP units of
a run, are the ``nn.ModuleList`` whose every element is an instance of one of those classes,
wherever the family keeps it::

    gpt2, falcon, bloom          transformer.h
    gpt_neox                     gpt_neox.layers
    opt                          model.decoder.layers
    llama, qwen2, gemma, ...     model.layers

Lists inside the text decoder Transformers names (``get_decoder()``: a multimodal model's
language model, not its vision tower) come first; among several the shallowest is taken
(``model.layers`` before an image encoder's ``...encoder.layers``), then the longest. A
model whose metadata names nothing that matches falls back to the usual attribute paths
under its base model (:data:`BLOCK_PATHS`), taking a list of one repeated class. A model
with neither is refused with what it does hold (:class:`NoBlocksError`): the run shards
block by block, and one FSDP unit of a whole model would gather all of it at once.

An element counts by its class or any base class (``fully_shard`` gives a module a
subclass, ``FSDPLlamaDecoderLayer``), and inside activation checkpointing's wrapper.
"""

from __future__ import annotations

from torch import nn

__all__ = ["BLOCK_PATHS", "NoBlocksError", "block_class_names", "find_blocks"]

BLOCK_PATHS = ("layers", "h", "blocks", "layer", "decoder.layers", "decoder.layer", "decoder.blocks", "encoder.layer",
               "encoder.layers")
"""Attribute paths under the base model tried when ``_no_split_modules`` finds no blocks."""


class NoBlocksError(ValueError):
    """A model in which no ``nn.ModuleList`` of blocks can be found."""


def block_class_names(model: nn.Module) -> set[str]:
    """The class names ``model`` (and any Transformers model inside it) gives in ``_no_split_modules``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def _unwrapped(module: nn.Module) -> nn.Module:
    return getattr(module, "_checkpoint_wrapped_module", module)


def _is_instance(module: nn.Module, names: set[str]) -> bool:
    return any(cls.__name__ in names for cls in type(_unwrapped(module)).__mro__)


def _module_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]


def _element_classes(blocks: nn.ModuleList) -> list[str]:
    return sorted({type(_unwrapped(m)).__name__ for m in blocks})


def _decoder(model: nn.Module) -> nn.Module | None:
    """The text decoder Transformers names (``get_decoder``): a multimodal model's language model."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    return decoder if isinstance(decoder, nn.Module) else None


def _by_metadata(model: nn.Module, names: set[str]) -> nn.ModuleList | None:
    for scope in (_decoder(model), model):  # the decoder's blocks before a vision tower's
        if scope is None:
            continue
        found = [(n.count("."), -len(m), i, m) for i, (n, m) in enumerate(_module_lists(scope))
                 if all(_is_instance(b, names) for b in m)]
        if found:
            return min(found)[-1]  # the shallowest, then the longest, then the first
    return None


def _by_path(model: nn.Module) -> nn.ModuleList | None:
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    for path in BLOCK_PATHS:
        try:
            blocks = base.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList) and len(blocks) and len(_element_classes(blocks)) == 1:
            return blocks
    return None


def _refusal(model: nn.Module, names: set[str]) -> NoBlocksError:
    lists = "; ".join(f"{n}: {_element_classes(m)}" for n, m in _module_lists(model)) or "none"
    classes = list(dict.fromkeys(type(m).__name__ for m in model.modules()))
    return NoBlocksError(
        f"{type(model).__name__} has no nn.ModuleList of blocks to shard: its _no_split_modules names "
        f"{sorted(names) or 'no classes'}, its ModuleLists hold {lists}, and the classes found are {classes}. "
        f"shardwise train shards a causal LM block by block: give a model whose repeated layers sit in one "
        f"nn.ModuleList, of a class its _no_split_modules names")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``model``'s blocks, in forward order; raises :class:`NoBlocksError`."""
    names = block_class_names(model)
    blocks = _by_metadata(model, names) if names else None
    if blocks is None:
        blocks = _by_path(model)
    if blocks is None:
        raise _refusal(model, names)
    return blocks
