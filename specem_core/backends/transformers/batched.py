"""The member's side of cross-request batching on one device (mixed into
:class:`~specem_core.backends.transformers.member.TransformersMember`).

Concurrent requests share the device: their forward passes run one at a time through the device's
queue (:mod:`specem_core.backends._batching`), and the one-token decode steps, prompt prefills and
verification blocks that several sessions of one model wait on are merged into one padded pass.
What this side needs of a session is :class:`BatchSession`; what a session needs of this side is
the public methods of :class:`BatchedPasses`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specem_core.backends._batching import BatchStats, DeviceQueue, Step, device_queue
from specem_core.errors import ConfigError


class BatchSession(Protocol):
    """What a merged pass needs of a session (a ``TransformersSession``)."""

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids."""
        ...

    @property
    def kv(self) -> Any:
        """The session's ``DynamicCache`` (its layers are read and re-pointed in place)."""
        ...

    def kv_length(self) -> int:
        """Positions held by the cache."""
        ...

    def batchable(self) -> bool:
        """Whether the cache can be stacked with others' (one row, every layer filled)."""
        ...

    def forward(self, ids: Sequence[int]) -> Any:
        """The session's own (unmerged) pass over ``ids``: next-token logits."""
        ...

    def set_length(self, n: int) -> None:
        """Crop the cache to ``n`` positions (a view)."""
        ...


PREFILL_TOKENS = 8192
"""At most this many (padded) prompt tokens in one merged prefill pass (bounds its memory)."""


@dataclass
class ScoreJob:
    """One session's verification block: candidate rows on its committed prefix cut at ``base``."""

    session: BatchSession
    base: int
    seqs: list[list[int]]
    """Per candidate: the tokens fed after ``base`` (the re-read prefix tail, the candidate, EOS)."""
    first_scored: int
    """The first row position whose token is scored (its logits come from the position before)."""

    @property
    def width(self) -> int:
        return max(len(s) for s in self.seqs)


@dataclass
class Block:
    """A verification block's result: logits of row positions ``offset`` .. and the rows' KV."""

    logits: Any
    layers: list[tuple[Any, Any]]
    pad: int
    offset: int


class BatchedPasses:
    """The member's side of cross-request batching (mixed into :class:`TransformersMember`)."""

    model: Any
    pad_id: int
    device: Any
    cache_arg: str
    _request_batch_size: int

    @property
    def request_batch_size(self) -> int:
        """At most this many concurrent requests' one-token decode steps share a forward pass.

        With more than 1 (default 16), every forward pass of a member on this device goes through
        one queue: passes run one at a time, and the decode steps that sessions drafting at the
        same time wait on are merged into one left-padded batch (each row keeps its own positions
        and mask). A lone request takes the unbatched path, so its numerics do not change; merged
        rows agree with it up to floating-point rounding. 1 restores the unqueued behaviour
        (concurrent requests run their passes side by side).
        """
        return self._request_batch_size

    @request_batch_size.setter
    def request_batch_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"request_batch_size must be an integer >= 1, got {value!r}")
        self._request_batch_size = value

    @property
    def batch_stats(self) -> BatchStats | None:
        """What the device queue did so far (shared by the members on this device), or ``None``
        when batching is off."""
        queue = self.queue()
        return queue.stats if queue is not None else None

    def queue(self) -> DeviceQueue | None:
        return device_queue(str(self.device)) if self._request_batch_size > 1 else None

    def submit(self, queue: DeviceQueue, kind: str, payload: Any, run: Any) -> Any:
        """Wait for ``payload``'s turn in a merged pass of this model's ``kind`` steps."""
        return queue.step(Step((id(self.model), kind), payload, run, self._request_batch_size, kind=kind))

    def decode_rows(self, steps: Sequence[Step[tuple[BatchSession, int]]]) -> list[Any]:
        """One forward pass for several sessions' one-token steps; next-token logits per step.

        Each session's cache is left-padded to the longest and stacked; the attention mask hides
        the padding and ``position_ids`` keep each row's own positions, so a row computes what the
        session would alone (up to rounding). The new KV row goes back to each session's cache.
        """
        torch = torch_module()
        sessions = [s.payload[0] for s in steps]
        if len(steps) == 1 or not all(s.batchable() for s in sessions):
            return [sess.forward([step.payload[1]]) for sess, step in zip(sessions, steps, strict=True)]
        lengths = [sess.kv_length() for sess in sessions]
        width, rows = max(lengths), len(sessions)
        with torch.inference_mode():
            stacked = stack_prefixes([(sess.kv.layers, n, 1) for sess, n in zip(sessions, lengths, strict=True)])
            mask = torch.zeros((rows, width + 1), dtype=torch.long, device=self.device)
            for row, n in enumerate(lengths):
                mask[row, width - n :] = 1
            output = self.model(
                input_ids=torch.tensor([[step.payload[1]] for step in steps], dtype=torch.long, device=self.device),
                attention_mask=mask,
                position_ids=torch.tensor([[n] for n in lengths], dtype=torch.long, device=self.device),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_arg: stacked},
            )
            merged_layers: list[Any] = list(stacked.layers)
            for row, sess in enumerate(sessions):
                for layer, merged in zip(sess.kv.layers, merged_layers, strict=True):
                    layer.keys = torch.cat([layer.keys, merged.keys[row : row + 1, :, -1:, :]], dim=-2)
                    layer.values = torch.cat([layer.values, merged.values[row : row + 1, :, -1:, :]], dim=-2)
            logits = output.logits[:, -1].float()
            return [logits[row].clone() for row in range(rows)]

    def prefill_steps(self, steps: Sequence[Step[BatchSession]]) -> list[Any]:
        """Prompt prefills of several new sessions, right-padded into passes of at most
        ``PREFILL_TOKENS`` padded tokens; next-token logits per session."""
        sessions = [step.payload for step in steps]
        order = sorted(range(len(sessions)), key=lambda i: len(sessions[i].prompt_ids))
        results: dict[int, Any] = {}
        chunk: list[int] = []
        for i in order:  # shortest first, so that a pass pads little
            longest = len(sessions[i].prompt_ids)
            if chunk and longest * (len(chunk) + 1) > PREFILL_TOKENS:
                results.update(zip(chunk, self.prefill_together([sessions[j] for j in chunk]), strict=True))
                chunk = []
            chunk.append(i)
        results.update(zip(chunk, self.prefill_together([sessions[j] for j in chunk]), strict=True))
        return [results[i] for i in range(len(sessions))]

    def prefill_together(self, sessions: Sequence[BatchSession]) -> list[Any]:
        """One pass over several prompts on empty caches (right-padded); each session keeps its rows."""
        if len(sessions) == 1:
            return [sessions[0].forward(sessions[0].prompt_ids)]
        torch = torch_module()
        from transformers import DynamicCache

        lengths = [len(sess.prompt_ids) for sess in sessions]
        width = max(lengths)
        last = sorted({n - 1 for n in lengths})  # the positions whose logits are needed
        with torch.inference_mode():
            mask = torch.zeros((len(sessions), width), dtype=torch.long, device=self.device)
            for row, n in enumerate(lengths):
                mask[row, :n] = 1
            ids = [sess.prompt_ids + [self.pad_id] * (width - n) for sess, n in zip(sessions, lengths, strict=True)]
            cache = DynamicCache()
            output = self.model(
                input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=torch.tensor(last, dtype=torch.long, device=self.device),
                **{self.cache_arg: cache},
            )
            logits = output.logits.float()
            merged: list[Any] = list(cache.layers)
            out = []
            for row, (sess, n) in enumerate(zip(sessions, lengths, strict=True)):
                for index, layer in enumerate(merged):  # a copy per session: the padded pass is freed
                    keys, values = layer.keys[row : row + 1, :, :n, :], layer.values[row : row + 1, :, :n, :]
                    sess.kv.update(keys, values, index)
                out.append(logits[row, last.index(n - 1)].clone())
            return out

    def score_steps(self, steps: Sequence[Step[ScoreJob]]) -> list[Block]:
        return self.score_blocks([step.payload for step in steps])

    def score_blocks(self, jobs: Sequence[ScoreJob]) -> list[Block]:
        """One forward pass for the verification blocks of one or more sessions.

        Alone, a session's candidate rows share its cache (expanded, no copy). Several sessions'
        rows are stacked like decode steps: each session's prefix left-padded to the longest and
        copied into its rows, the candidates right-padded, positions per row.
        """
        torch = torch_module()
        with torch.inference_mode():
            if len(jobs) == 1 or not all(job.session.batchable() for job in jobs):
                return [self.score_alone(job) for job in jobs]
            width = max(job.width for job in jobs)
            length = max(job.base for job in jobs)
            offset = min(job.first_scored - 1 for job in jobs)
            rows = sum(len(job.seqs) for job in jobs)
            stacked = stack_prefixes([(job.session.kv.layers, job.base, len(job.seqs)) for job in jobs])
            mask = torch.ones((rows, length + width), dtype=torch.long, device=self.device)
            input_ids, positions = [], []
            row = 0
            for job in jobs:
                for seq in job.seqs:
                    mask[row, : length - job.base] = 0
                    input_ids.append(seq + [self.pad_id] * (width - len(seq)))
                    positions.append(list(range(job.base, job.base + width)))
                    row += 1
            output = self.model(
                input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
                attention_mask=mask,
                position_ids=torch.tensor(positions, dtype=torch.long, device=self.device),
                use_cache=True,
                logits_to_keep=width - offset,
                **{self.cache_arg: stacked},
            )
            logits = output.logits.float()
            merged: list[Any] = [(layer.keys, layer.values) for layer in stacked.layers]
            blocks, row = [], 0
            for job in jobs:
                n = len(job.seqs)
                layers_of_job = [(k[row : row + n], v[row : row + n]) for k, v in merged]
                blocks.append(Block(logits[row : row + n], layers_of_job, length - job.base, offset))
                row += n
            return blocks

    def score_alone(self, job: ScoreJob) -> Block:
        """One session's block on its own cache, expanded to the candidates (the unbatched path)."""
        torch = torch_module()
        session = job.session
        cache = session.kv
        keep = job.width - (job.first_scored - 1)
        snapshot = [(layer.keys, layer.values) for layer in cache.layers]
        session.set_length(job.base)
        batch = len(job.seqs)
        if batch > 1:
            for layer in cache.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys = layer.keys.expand(batch, -1, -1, -1)
                    layer.values = layer.values.expand(batch, -1, -1, -1)
        input_ids = torch.tensor(
            [s + [self.pad_id] * (job.width - len(s)) for s in job.seqs], dtype=torch.long, device=self.device
        )
        try:
            output = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **{self.cache_arg: cache})
            layers = [(layer.keys, layer.values) for layer in cache.layers]
        finally:
            for layer, (keys, values) in zip(cache.layers, snapshot, strict=True):
                layer.keys, layer.values = keys, values
        return Block(output.logits.float(), layers, 0, job.width - keep)


def torch_module() -> Any:
    import torch

    return torch


def stack_prefixes(parts: Sequence[tuple[Any, int, int]]) -> Any:
    """A ``DynamicCache`` holding, per part ``(cache layers, length, rows)``, ``rows`` copies of the
    first ``length`` cached positions, left-padded with zeros to the longest part."""
    from transformers import DynamicCache

    longest = max(length for _, length, _ in parts)
    total = sum(rows for _, _, rows in parts)
    stacked = DynamicCache()
    for index, layers in enumerate(zip(*(layers for layers, _, _ in parts), strict=True)):
        keys = layers[0].keys.new_zeros((total, layers[0].keys.shape[1], longest, layers[0].keys.shape[3]))
        values = layers[0].values.new_zeros((total, layers[0].values.shape[1], longest, layers[0].values.shape[3]))
        row = 0
        for layer, (_, length, rows) in zip(layers, parts, strict=True):
            keys[row : row + rows, :, longest - length :, :] = layer.keys[:, :, :length, :]
            values[row : row + rows, :, longest - length :, :] = layer.values[:, :, :length, :]
            row += rows
        stacked.update(keys, values, index)
    return stacked
