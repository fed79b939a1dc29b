"""
infra/one_call.py: kl_control.LoGRAOptimizer for a trainer, its settings picked by how the model's weights
start. `start="pretrained"` is the paper's controller (kl_control's defaults: the README's three calls bit for
bit), `start="scratch"` SCRATCH (the settings for random weights, below), `start="auto"` (the default) the
model's transformers config's: "pretrained" when it names where it was loaded from (from_pretrained),
"scratch" when it names nothing; without a config "scratch", with a warning at the caller's line. A setting
given explicitly wins over its start's. The probe is infra/probe_decoder.py's `fast_probe` unless `probe=`
is given (kl_control's default is its reference). After each step, a step post-hook passes each of `last`
to `log(name, value)`.

SCRATCH's departures from the paper, kl_control.py's numbering (reason: bench/README.md's table; test):
5. KL1 calibrated by rho (`calibrate`, Calibration): random weights realised half the prediction (`defaults_why`);
   test_the_calibration_rule, test_calibration_spends_the_budget_in_realised_kl.
6. RowAdam's step scaled per layer (random weights, `defaults_why`); test_start_reads_how_the_model_was_made,
   test_the_one_call_optimizer_is_the_three_calls_bitwise.
8. alpha_max 9, entropy share 0.4 (random weights, `defaults_tuning`; trained: `defaults_smollm2`);
   test_the_budgets_shares.
"""

import math
import warnings

import kl_control
from infra.probe_decoder import fast_probe

SCRATCH = dict(per_layer=True, alpha_max=9.0, entropy_share=0.4, calibrate=True)  # random weights: 5, 6, 8 above
STARTS = {"pretrained": dict(per_layer=False, alpha_max=3.0, entropy_share=kl_control.ENTROPY_SHARE, calibrate=False),
          "scratch": SCRATCH}
CALIBRATION_POSITIONS = 256  # positions whose logits calibration keeps (departure 5; 78 MB at V = 152k in bf16)


def model_start(model) -> str | None:
    """"pretrained" when the model's transformers config names where it was loaded from, "scratch"
    when it names nothing, None without one (`.module`, a wrapper's model, looked through)."""
    for m in (model, getattr(model, "module", None)):
        name = getattr(getattr(m, "config", None), "name_or_path", None)
        if isinstance(name, str):
            return "pretrained" if name else "scratch"
    return None


class Calibration:
    """Departure 5: rho, KL1's scale learnt where the budget bound: log rho <- 0.7 log rho + 0.3 log
    clamp(realised / (alpha^2 KL1), 0.1, 10); then alpha = min(alpha_max, sqrt(budget / (rho KL1)))."""
    KEYS = ("log_scale", "momentum", "low", "high")  # its state

    def __init__(self, momentum=0.7, low=0.1, high=10.0):
        if not 0.0 <= momentum < 1.0 or not 0.0 < low <= 1.0 <= high:
            raise ValueError(f"need 0 <= momentum < 1 and 0 < low <= 1 <= high, got {momentum}, {low}, {high}")
        self.momentum, self.low, self.high, self.log_scale = momentum, low, high, 0.0

    @property
    def scale(self) -> float:
        return math.exp(self.log_scale)

    def observe(self, realised, predicted):
        """Learn from one update: the clamped ratio, or None (nothing learnt)."""
        realised, predicted = float(realised), float(predicted)
        if not (math.isfinite(realised) and math.isfinite(predicted) and predicted > 0):
            return None
        ratio = min(max(realised / predicted, self.low), self.high)
        self.log_scale = self.momentum * self.log_scale + (1.0 - self.momentum) * math.log(ratio)
        return ratio

    def state_dict(self):
        return {k: getattr(self, k) for k in self.KEYS}

    def load_state_dict(self, state):
        self.log_scale, self.momentum, self.low, self.high = (float(state[k]) for k in self.KEYS)


def after_step(opt, args, kwargs):
    """LoGRAOptimizer's step post-hook: `log` each of `last`."""
    for name, value in opt.last.items():
        opt.log(f"logra/{name}", value)


class LoGRAOptimizer(kl_control.LoGRAOptimizer):
    """kl_control.LoGRAOptimizer(model, rowadam, **STARTS[start], **settings): a setting left None takes its
    start's; `start` ("auto": model_start's) is kept as `self.start`. `calibrate`: alpha from rho KL1
    (`self.calibration`), rho learnt from the realised KL at `keep_positions` (by default CALIBRATION_POSITIONS).
    `log(name, value)`: `after_step`'s."""

    def __init__(self, model, rowadam, *, start="auto", log=None, **settings):
        if start not in ("auto", *STARTS):
            raise ValueError(f"start must be 'auto', 'pretrained' or 'scratch', got {start!r}")
        unknown = start == "auto" and model_start(model) is None
        self.start = (model_start(model) or "scratch") if start == "auto" else start
        settings = {**STARTS[self.start], "probe": fast_probe, **{k: v for k, v in settings.items() if v is not None}}
        calibrate = settings.pop("calibrate")
        settings.setdefault("keep_positions", CALIBRATION_POSITIONS if calibrate else 0)
        if calibrate and settings["keep_positions"] == 0:
            raise ValueError("calibrate=True learns from the realised KL: it needs keep_positions > 0")
        super().__init__(model, rowadam, **settings)
        self.calibration = Calibration() if calibrate else None
        self.log = log or (lambda name, value: None)
        self.register_step_post_hook(after_step)
        if unknown:
            warnings.warn("LoGRAOptimizer: this model has no transformers config to tell whether its weights were "
                          "trained, so it takes the settings for random weights (start='scratch'). For trained "
                          "weights pass start='pretrained' (the paper's controller; bench/README.md, "
                          "defaults_smollm2); pass start='scratch' to silence this.", stacklevel=2)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)  # its refusals (calibrate, per_layer) come before anything is loaded
        if self.calibration is not None:  # a state from before calibration existed: rho starts at 1
            self.calibration.load_state_dict(state.get("calibration") or {**self.calibration.state_dict(),
                                                                          "log_scale": 0.0})
