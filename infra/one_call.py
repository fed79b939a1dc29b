"""
infra/one_call.py: kl_control.LoGRAOptimizer with its settings picked by how the model's weights
start: `start="pretrained"` the paper's controller (kl_control's defaults: the README's three
calls bit for bit), `start="scratch"` kl_control.SCRATCH (RowAdam's step per layer, alpha_max 9,
entropy share 0.4, the prediction calibrated: kl_control.py's departures 5, 6, 8), `start="auto"`
(the default) the model's transformers config's: "pretrained" when it names where it was loaded
from (from_pretrained), "scratch" when it names nothing; without a config "scratch", with a
warning at the caller's line. A setting given explicitly wins over its start's. The probe is
infra/probe_decoder.py's `fast_probe` unless `probe=` is given (kl_control's default is its reference).
"""

import warnings

import kl_control
from infra.probe_decoder import fast_probe

STARTS = {"pretrained": dict(per_layer=False, alpha_max=3.0, entropy_share=kl_control.ENTROPY_SHARE, calibrate=False),
          "scratch": kl_control.SCRATCH}


def model_start(model) -> str | None:
    """"pretrained" when the model's transformers config names where it was loaded from, "scratch"
    when it names nothing, None without one (`.module`, a wrapper's model, looked through)."""
    for m in (model, getattr(model, "module", None)):
        name = getattr(getattr(m, "config", None), "name_or_path", None)
        if isinstance(name, str):
            return "pretrained" if name else "scratch"
    return None


class LoGRAOptimizer(kl_control.LoGRAOptimizer):
    """kl_control.LoGRAOptimizer(model, rowadam, **STARTS[start], **settings): a setting left None
    takes its start's; `start` ("auto": model_start's) is kept as `self.start`."""

    def __init__(self, model, rowadam, *, start="auto", **settings):
        if start not in ("auto", *STARTS):
            raise ValueError(f"start must be 'auto', 'pretrained' or 'scratch', got {start!r}")
        unknown = start == "auto" and model_start(model) is None
        self.start = (model_start(model) or "scratch") if start == "auto" else start
        given = {k: v for k, v in settings.items() if v is not None}
        super().__init__(model, rowadam, **{**STARTS[self.start], "probe": fast_probe, **given})
        if unknown:
            warnings.warn("LoGRAOptimizer: this model has no transformers config to tell whether its weights were "
                          "trained, so it takes the settings for random weights (start='scratch'). For trained "
                          "weights pass start='pretrained' (the paper's controller; bench/README.md, "
                          "defaults_smollm2); pass start='scratch' to silence this.",
                          stacklevel=kl_control._caller_stacklevel(__file__))
