"""``kvpress:``: any scorer press of NVIDIA's kvpress as a policy, scored by the press itself.

``kvpress:<PressClass>[,<field>=<value>...]``, e.g.
``kvpress:SnapKVPress,compression_ratio=0.5,window_size=64``. At prefill the policy calls, for
every layer, the press's own ``score(module, hidden_states, keys, values, attentions, kwargs)``
with the layer's real attention module, the hidden states that entered it, its cached keys and
values ``(1, kv_heads, length, head_dim)`` and its forward keyword arguments (recorded by the
tracer, see :class:`~kvcouple.policies.context.LayerInputCapture`); ``attentions`` (the layer's
attention probabilities, ``(1, heads, length, length)``) is given to the presses that require it
(:data:`NEEDS_ATTENTIONS`) and is ``None`` otherwise, as kvpress's hook gets it under ``sdpa``.
The entries of highest score are kept per layer and KV head (ties: the lower position).

Kept count: with ``compression_ratio=r`` alone, ``int((n - 1) * (1 - r))`` prefix entries
(kvpress's rounding, on the prefix it would compress) plus the re-fed last token; with
``retain=``/``budget=`` kvcouple's counts. Either way the press scores with a compression ratio
that keeps exactly that many (some presses, e.g. ``StreamingLLMPress``, read it).

Presses that are not ``ScorerPress`` subclasses rewrite the cache themselves and are refused
when the spec is parsed, as are fields a spec cannot express. ``mode=decode`` re-scores the
current cache (as kvpress's ``DecodingPress``) for the presses whose score reads only keys and
values (:data:`KEYS_VALUES_ONLY`); the others need the newest tokens' hidden states, which the
tracer does not keep while decoding, and are refused with it. kvpress patches transformers'
attention functions when imported (a pass-through unless its head-wise masking is used).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar

from kvcouple.errors import MissingExtraError
from kvcouple.policies.base import Policy, top_indices
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.errors import PolicyError, PolicyParameterError

if TYPE_CHECKING:
    import torch

# Presses whose score needs the layer's attention probabilities (kvpress asserts them).
NEEDS_ATTENTIONS = frozenset({"ObservedAttentionPress"})
# Presses whose score reads only the cached keys and values: they can re-score while decoding.
KEYS_VALUES_ONLY = frozenset(
    {"KnormPress", "KeyDiffPress", "StreamingLLMPress", "RandomPress", "LagKVPress", "CURPress"}
)
INSTALL = "pip install 'kvcouple[kvpress]' (or: pip install kvpress; it needs transformers<5.3)"
# Policy keys that are kvcouple's, not the press's.
_OWN = ("retain", "budget", "mode", "every")


def import_kvpress() -> Any:
    """The kvpress module, or :class:`~kvcouple.errors.MissingExtraError` saying how to install
    it (or why the installed one cannot be imported)."""
    ours = _own_attention_functions()
    try:
        import kvpress  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "kvpress":
            raise
        raise MissingExtraError(f"kvpress: policies need kvpress: {INSTALL}") from e
    except ImportError as e:  # e.g. a transformers it does not support
        raise MissingExtraError(
            f"kvpress is installed but cannot be imported ({e}); kvpress 0.5 needs "
            f"transformers>=4.56,<5.3: {INSTALL}"
        ) from e
    finally:
        _restore(ours)
    return kvpress


# kvcouple's own entries in transformers' attention registry (kvcouple.tracer.attention
# registers them under this prefix).
_OWN_PREFIX = "kvcouple_"


def _own_attention_functions() -> dict[str, Any]:
    """kvcouple's registered attention functions, before kvpress's first import wraps every
    registered function (its wrapper passes ``dropout`` positionally, which kvcouple's refuses)."""
    import sys

    if "kvpress" in sys.modules:
        return {}
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {k: v for k, v in ALL_ATTENTION_FUNCTIONS.items() if k.startswith(_OWN_PREFIX)}


def _restore(ours: dict[str, Any]) -> None:
    if not ours:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in ours.items():
        ALL_ATTENTION_FUNCTIONS[name] = fn


def _field_kind(hint: Any) -> tuple[type, bool, tuple[Any, ...] | None] | None:
    """``(scalar type, optional, choices)`` of a dataclass field a spec can set, else None."""
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(rest) == len(args):
            return None
        optional, hint = True, rest[0]
        args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        kinds = {type(a) for a in args}
        return (kinds.pop(), optional, args) if len(kinds) == 1 else None
    if hint in (bool, int, float, str):
        return hint, optional, None
    return None


def _format(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class KVPress(Policy):
    """A kvpress ``ScorerPress`` run as a policy: its own ``score`` decides what is kept.

    Parameters are the items of a spec string parsed by :func:`kvcouple.policies.parse_policy`
    (``"kvpress:KnormPress,compression_ratio=0.5"``) or keyword arguments.

    Parameters
    ----------
    **params
        The spec's items:

        - ``press`` (str): the press's class name in kvpress (the spec's first item);
        - ``retain``, ``budget`` (optional): kvcouple's kept count (see
          :class:`~kvcouple.policies.Policy`); without them the press's
          ``compression_ratio`` sets it;
        - ``mode``, ``every`` (optional): as for every policy; ``mode=decode`` only for
          :data:`KEYS_VALUES_ONLY` presses;
        - any other key: one of the press's dataclass fields (e.g. ``compression_ratio``,
          ``window_size``), parsed by its declared type (``none`` for an optional field's
          ``None``).
    """

    name = "kvpress"
    POSITIONAL = "press"
    NEEDS_LAYER_INPUTS = True
    PARAMS: ClassVar[dict[str, tuple[type, Any]]] = {"press": (str, None)}

    def __init__(self, **params: Any):
        press_name = params.get("press")
        if not press_name:
            raise PolicyParameterError(
                "policy 'kvpress' needs a press class name first, e.g. "
                "kvpress:SnapKVPress,compression_ratio=0.5"
            )
        kvpress = import_kvpress()
        cls = getattr(kvpress, str(press_name), None)
        scorers = sorted(
            n
            for n in dir(kvpress)
            if isinstance(getattr(kvpress, n), type)
            and issubclass(getattr(kvpress, n), kvpress.ScorerPress)
            and n != "ScorerPress"
        )
        if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)):
            raise PolicyParameterError(
                f"kvpress has no press {press_name!r}; its scorer presses: {', '.join(scorers)}"
            )
        if not issubclass(cls, kvpress.ScorerPress) or cls is kvpress.ScorerPress:
            raise PolicyParameterError(
                f"kvpress:{press_name} is not a scorer press: it rewrites the cache itself "
                "(its own compress), so there is no per-entry score for kvcouple to keep the "
                f"top of; scorer presses: {', '.join(scorers)}"
            )
        if getattr(cls, "compress", None) is not kvpress.ScorerPress.compress:
            raise PolicyParameterError(
                f"kvpress:{press_name} overrides ScorerPress.compress (it decides its own kept "
                "entries, e.g. a count per layer), so the top of its score is not what kvpress "
                "keeps"
            )
        # Wrappers (CriticalKVPress(press=...)) take another press object, as a required
        # argument or a press-typed field: a spec string cannot give one.
        required = [
            p.name
            for p in inspect.signature(cls).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        wrapped = required + [
            f.name
            for f in dataclasses.fields(cls)
            if (isinstance(f.type, str) and f.type.endswith("Press"))
            or (isinstance(f.type, type) and issubclass(f.type, kvpress.BasePress))
        ]
        if wrapped:
            raise PolicyParameterError(
                f"kvpress:{press_name} wraps another press ({', '.join(sorted(set(wrapped)))}), "
                "which a spec string cannot give"
            )
        self.press_class = cls
        given = {k: v for k, v in params.items() if k not in (*_OWN, "press")}
        if "compression_ratio" in given and (params.get("retain") or params.get("budget")):
            raise PolicyParameterError(
                f"kvpress:{press_name}: give compression_ratio= (kvpress's kept count) or "
                "retain=/budget= (kvcouple's), not both"
            )
        self.press = self._build(cls, given)
        super().__init__(**{k: v for k, v in params.items() if k in (*_OWN, "press")})
        self._initialised: set[int] = set()

    def _build(self, cls: type, given: dict[str, Any]) -> Any:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # unresolvable annotations: only the fields' own declarations
            hints = {}
        fields = {
            f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")
        }
        kinds = {n: _field_kind(hints.get(n, f.type)) for n, f in fields.items()}
        settable = [n for n, k in kinds.items() if k is not None]
        values: dict[str, Any] = {}
        for key, raw in given.items():
            if key not in fields:
                raise PolicyParameterError(
                    f"kvpress:{cls.__name__} has no field {key}; it takes "
                    f"{', '.join(settable)} (and kvcouple's {', '.join(_OWN)})"
                )
            kind = kinds[key]
            if kind is None:
                raise PolicyParameterError(
                    f"kvpress:{cls.__name__}: field {key} ({fields[key].type}) cannot be set "
                    "from a spec string"
                )
            values[key] = self._parse(cls.__name__, key, kind, raw)
        try:
            press = cls(**values)
        except Exception as e:  # the press's own checks (asserts, ValueErrors)
            raise PolicyParameterError(f"kvpress:{cls.__name__} refused {values}: {e!r}") from e
        self._fields = settable
        return press

    @staticmethod
    def _parse(press: str, key: str, kind: tuple[type, bool, Any], raw: Any) -> Any:
        typ, optional, choices = kind
        if not isinstance(raw, str):
            value = raw
        elif optional and raw.lower() == "none":
            return None
        elif typ is bool:
            low = raw.lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise PolicyParameterError(f"kvpress:{press}: {key}={raw!r} is not a valid bool")
            value = low in ("1", "true", "yes")
        else:
            try:
                value = typ(raw)
            except ValueError:
                raise PolicyParameterError(
                    f"kvpress:{press}: {key}={raw!r} is not a valid {typ.__name__}"
                ) from None
        if choices is not None and value not in choices:
            raise PolicyParameterError(
                f"kvpress:{press}: {key} must be one of {', '.join(map(str, choices))}, got {raw!r}"
            )
        return value

    def budget_implied(self) -> bool:
        return True  # the press's compression_ratio (kvpress's default 0: nothing evicted)

    def validate(self) -> None:
        name = self.press_class.__name__
        if self.decode_time and name not in KEYS_VALUES_ONLY:
            raise PolicyParameterError(
                f"kvpress:{name} with mode=decode: its score reads the hidden states or "
                "attention of the newest tokens, which the tracer does not keep while decoding; "
                f"mode=decode takes {', '.join(sorted(KEYS_VALUES_ONLY))} (or use a built-in "
                "policy, e.g. snapkv:mode=decode)"
            )

    @property
    def NEEDS_ATTENTION(self) -> bool:  # type: ignore[override]
        return self.press_class.__name__ in NEEDS_ATTENTIONS

    def prompt_queries(self) -> tuple[int | None, bool]:
        return (None if self.NEEDS_ATTENTION else 0), False

    def spec(self) -> str:
        own = [f"{k}={self.params[k]}" for k in _OWN if self.params.get(k) is not None]
        # With kvcouple's count the press's compression_ratio is not the user's: left out.
        counted = self.params["retain"] is not None or self.params["budget"] is not None
        names = [k for k in self._fields if not (counted and k == "compression_ratio")]
        fields = [f"{k}={_format(getattr(self.press, k))}" for k in names]
        return f"kvpress:{self.press_class.__name__}," + ",".join(own + fields)

    def kept_count(self, prompt_length: int) -> int:
        if self.params["retain"] is not None or self.params["budget"] is not None:
            return super().kept_count(prompt_length)
        ratio = float(getattr(self.press, "compression_ratio", 0.0) or 0.0)
        prefix = int((prompt_length - 1) * (1 - ratio))  # kvpress's compute_n_kept
        return max(1, min(prompt_length, prefix + 1))

    def _press_for(self, length: int, keep: int) -> Any:
        """The press with a compression ratio that keeps exactly ``keep`` of ``length``."""
        ratio = float(getattr(self.press, "compression_ratio", 0.0) or 0.0)
        if int(length * (1 - ratio)) == keep:
            return self.press
        ratio = (length - keep) / length
        for _ in range(64):  # float rounding: step down until int() gives keep
            if int(length * (1 - ratio)) >= keep:
                break
            ratio = math.nextafter(ratio, -math.inf)
        return dataclasses.replace(self.press, compression_ratio=max(0.0, ratio))

    def select(self, ctx: PolicyContext, keep: int) -> torch.Tensor:
        import torch

        n = ctx.length
        if keep == 0:
            return torch.zeros((ctx.num_layers, ctx.num_kv_heads, 0), dtype=torch.long)
        press = self._press_for(n, keep)
        decoding = ctx.layer_inputs_fn is None
        if decoding and self.press_class.__name__ not in KEYS_VALUES_ONLY:
            raise PolicyError(f"kvpress:{self.press_class.__name__} needs the layer inputs")
        out = []
        for layer in range(ctx.num_layers):
            keys, values = ctx.keys[layer][None], ctx.values[layer][None]
            module, hidden, kwargs = None, None, {}
            if not decoding:
                inputs = ctx.layer_inputs(layer)
                module, hidden, kwargs = self._module(inputs), inputs.hidden_states, inputs.kwargs
                if id(inputs.model) not in self._initialised:
                    press.post_init_from_model(inputs.model)
                    self._initialised.add(id(inputs.model))
            attentions = None
            if self.NEEDS_ATTENTION:
                attentions = ctx.attention(layer).to(keys.dtype)[None]
            with torch.no_grad():
                s = press.score(module, hidden, keys, values, attentions, kwargs)
            if tuple(s.shape) != (1, ctx.num_kv_heads, n):
                raise PolicyError(
                    f"kvpress:{self.press_class.__name__} scored layer {layer} with shape "
                    f"{tuple(s.shape)}, expected (1, {ctx.num_kv_heads}, {n})"
                )
            out.append(top_indices(s[0].float(), keep))
        return torch.stack(out)

    @staticmethod
    def _module(inputs: Any) -> Any:
        """The attention module as kvpress's hook sees it: with the model's rotary embedding
        as ``rotary_emb`` (kvpress sets that attribute on the model's modules; here a shallow
        copy of the module gets it, the model's own module is left as it is)."""
        import copy

        module = inputs.module
        if inputs.rotary_emb is None or hasattr(module, "rotary_emb"):
            return module
        view = copy.copy(module)
        view._modules = {**module._modules, "rotary_emb": inputs.rotary_emb}
        return view


__all__ = ["INSTALL", "KEYS_VALUES_ONLY", "KVPress", "NEEDS_ATTENTIONS", "import_kvpress"]
