"""OutputLoss: the loss over an output layer that may be spread across a replica's workers.

One worker holding every output uses the reference's own loss, kept in the autograd graph.
Workers that each hold some outputs exchange a few values per example in one all-gather and
merge them exactly (the log-sum-exp rule for cross-entropy, a sum for mean squared error);
the same collective carries the replica's stop flag, so a step costs one collective round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from netpart.errors import ShapeMismatchError
from netpart.models.spec import ModelSpec
from netpart.runtime.transport import Transport

__all__ = ["LossResult", "OutputLoss"]


@dataclass(frozen=True)
class LossResult:
    """One step's loss (same on every worker), the batch accuracy (cross-entropy only) and
    whether some worker of the replica asked to stop after this step."""

    loss: float
    accuracy: float | None
    stop: bool


class OutputLoss:
    """The loss of `spec` over this worker's output units `owned` (sorted unit ids).

    Its results equal the single-process reference's loss on the whole output layer: the
    distributed gradient is exactly the reference's gradient restricted to `owned`.
    """

    def __init__(self, spec: ModelSpec, owned: np.ndarray, dtype: torch.dtype) -> None:
        self.spec, self.dtype = spec, dtype
        self.n_out = spec.shapes[-1].size
        self._owned = torch.as_tensor(owned, dtype=torch.int64)
        # Cross-entropy: for each class, its column among this worker's outputs (n if none).
        slot = np.full(self.n_out, len(owned), dtype=np.int64)
        slot[owned] = np.arange(len(owned))
        self._slot = slot

    def alone(
        self, out: torch.Tensor, targets: torch.Tensor, flag: float, want_accuracy: bool
    ) -> tuple[torch.Tensor, LossResult]:
        """One worker holds every output ([n_out, B], in order): the reference's loss as a
        graph node (to call backward from) and its figures."""
        logits, batch = out.T, out.shape[1]
        accuracy = None
        if self.spec.loss == "cross_entropy":
            if targets.shape != (batch,):
                raise ShapeMismatchError(
                    f"targets must be [{batch}] class ids, got {targets.shape}"
                )
            loss = torch.nn.functional.cross_entropy(logits, targets)
            if want_accuracy:  # small arrays: numpy's operations cost a microsecond
                z = out.detach().numpy()  # [n_out, B], contiguous
                target = z[targets.numpy(), np.arange(batch)]
                accuracy = np.count_nonzero(target >= z.max(axis=0)) / batch
        else:
            want = targets.reshape(batch, -1).to(self.dtype)
            loss = torch.nn.functional.mse_loss(logits, want)
        return loss, LossResult(loss.item(), accuracy, flag > 0)

    def shared(
        self, out: torch.Tensor, targets: torch.Tensor, transport: Transport, flag: float
    ) -> tuple[torch.Tensor, LossResult]:
        """This worker's outputs [U, B] of a layer spread over the transport's workers: the
        gradient of the global loss w.r.t. them ([U, B]) and the step's figures, from one
        all-gather of a few values per example."""
        logits = out.detach().T  # [B, U]
        if self.spec.loss != "cross_entropy":
            return self._mse(logits, targets, transport, flag)
        return self._cross_entropy(logits, targets, transport, flag)

    def exchange_only(self, batch: int, transport: Transport) -> None:
        """The collective of `shared` on stand-in values of the same size (exchange-only
        steps time a program's messages without its arithmetic)."""
        values = 3 * batch + 1 if self.spec.loss == "cross_entropy" else 2
        _gather(transport, torch.zeros(values, dtype=self.dtype))

    def _cross_entropy(self, logits, targets, transport, flag):
        """Each worker contributes, per example, its max logit, its sum of exp(logit - max)
        and its target logit (-inf unless it owns the target's unit); the log-sum-exp rule
        merges them exactly. A target logit equal to the global max counts as correct."""
        batch, n = logits.shape
        if targets.shape != (batch,):
            raise ShapeMismatchError(f"targets must be [{batch}] class ids, got {targets.shape}")
        # Small arrays: numpy's operations cost a microsecond, torch's several.
        pos = self._slot[targets.numpy()]  # the target's column here, n if another's
        padded = np.full((batch, n + 1), -np.inf, dtype=logits.numpy().dtype)
        padded[:, :n] = logits.numpy()
        local_max = padded.max(axis=1)
        exps = np.exp(padded - local_max[:, None]) if n else np.zeros_like(padded)
        mine = np.concatenate(
            [local_max, exps.sum(axis=1), padded[np.arange(batch), pos], [flag]]
        ).astype(padded.dtype)
        gathered = _gather(transport, torch.from_numpy(mine)).numpy()
        maxes, sums, targets_all = gathered[:, :-1].reshape(-1, 3, batch).transpose(1, 0, 2)
        gmax = maxes.max(axis=0)
        with np.errstate(invalid="ignore"):  # a worker with no outputs sends -inf and 0
            lse = gmax + np.log(np.nansum(sums * np.exp(maxes - gmax), axis=0))
        target_logit = targets_all.max(axis=0)  # exactly one worker owns each target
        result = LossResult(
            float((lse - target_logit).mean()),
            float((target_logit >= gmax).mean()),
            bool(gathered[:, -1].max() > 0),
        )
        if not n:
            return logits.new_zeros(0, batch), result
        grad = exps * np.exp(local_max - lse)[:, None]  # softmax over all workers
        grad[np.arange(batch), pos] -= 1.0
        return torch.from_numpy(grad[:, :n] / batch).T, result

    def _mse(self, logits, targets, transport, flag):
        batch = logits.shape[0]
        t = targets.reshape(batch, -1).to(self.dtype)[:, self._owned]
        diff = logits - t
        mine = torch.stack([(diff * diff).sum(), torch.tensor(flag, dtype=diff.dtype)])
        gathered = _gather(transport, mine)
        scale = batch * self.n_out
        result = LossResult(
            float(gathered[:, 0].sum() / scale), None, bool(gathered[:, 1].amax() > 0)
        )
        return (2.0 * diff / scale).T, result


def _gather(transport: Transport, values: torch.Tensor) -> torch.Tensor:
    """[workers, n]: every worker's values (no message at all for one worker)."""
    if transport.size == 1:
        return values[None]
    return transport.all_gather(values)
