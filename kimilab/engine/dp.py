"""One device of a DP-attention instance, run as an engine of its own.

Under DP-attention (``deployment.attention == "dp"``) each device holds whole requests
in its own memory and runs their attention itself; the experts are shared through the
step's all-to-alls. The book models such an instance as its ``n`` devices each running
an :class:`~kimilab.engine.Engine` with its own pool and prefix cache, requests routed
to devices. A device's step is timed as the instance's step when every device carries a
batch like its own (:class:`DpDeviceTimer`): its own KV and state reads and attention,
the weights and collectives of ``n`` times its tokens.

What this leaves out: the devices step in lock-step, so in a real instance the busiest
device sets everyone's step (here each device runs at its own pace), an idle device
still joins the collectives, and a long prefill chunk on one device stalls the others'
decodes. Balanced load hides all three; skewed load makes this approximation optimistic.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, StepTimer, step_work

__all__ = ["DpDeviceTimer"]


class DpDeviceTimer(StepTimer):
    """Step seconds of ONE device of a DP-attention ``deployment`` whose ``n`` devices all carry
    a batch like this one: equal to ``step_seconds(cfg, dep, decode=(n * d, n * ctx), chunks=chunks * n)``
    (a test holds them equal)."""

    def __init__(self, cfg: ModelConfig, deployment: Deployment):
        if deployment.attention != "dp":
            raise ValueError(f"deployment={deployment.name!r}: a DP device timer needs DP-attention")
        super().__init__(cfg, deployment)
        self._plain = True  # this device's own batch: its mixers' work, no busiest-share max
        self._n = deployment.n_devices

    def _fixed_part(self, tokens: int) -> float:
        t = self._fixed.get(tokens)
        if t is None:  # the weights, experts' collectives and overhead of n devices' tokens
            parts = step_work(self.cfg, self.deployment, decode=(self._n * tokens, 0)).parts()
            t = self._fixed[tokens] = parts["overhead"] + parts["communication"] + parts["weights"]
        return t
