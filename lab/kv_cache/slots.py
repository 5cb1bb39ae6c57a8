"""SlotKVCacheManager: stage 2D's slot allocator. Each running request owns one slot of `max_len`
tokens, found free at admission, stable for the request's life, freed at finish and reused.

Owns: slot ids. Ignores: tensor contents (BlockKVCache stores a slot as one block of `max_len` tokens, so
the storage is the preallocated [num_slots, max_len] per layer the stage describes).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.kv_cache.manager import NO_PREFIX, CachedPrefix
from lab.request import Request


class SlotKVCacheManager:
    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_blocks, self.block_size = num_slots, max_len
        self._free_slots = list(range(num_slots))   # a min-heap: the lowest free slot is reused first
        self.slot_ids: dict[str, int] = {}
        self.max_slot_id = -1

    @property
    def num_slots(self) -> int:
        return self.num_blocks

    @property
    def max_len(self) -> int:
        return self.block_size

    @property
    def num_held_blocks(self) -> int:
        return len(self.slot_ids)

    def can_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_len

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        return NO_PREFIX

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        if request.num_computed_tokens + num_new_tokens > self.max_len:
            return False
        if request.request_id in self.slot_ids:
            return True   # NOTE: a slot reserves max_len tokens up front; growing needs nothing
        if not self._free_slots:
            return False
        slot_id = heapq.heappop(self._free_slots)
        self.slot_ids[request.request_id] = slot_id
        self.max_slot_id = max(self.max_slot_id, slot_id)
        return True

    def free(self, request: Request) -> None:
        slot_id = self.slot_ids.pop(request.request_id, None)
        if slot_id is not None:
            heapq.heappush(self._free_slots, slot_id)

    def reset_prefix_cache(self) -> None:
        pass   # NOTE: slots share nothing between requests

    def block_table(self, request_id: str) -> list[int]:
        slot_id = self.slot_ids.get(request_id)
        return [] if slot_id is None else [slot_id]

    def stats(self) -> dict[str, float]:
        return {"kv/num_slots": self.num_slots, "kv/slot_len": self.max_len,
                "kv/num_held_slots": self.num_held_blocks, "kv/max_slot_id": self.max_slot_id}


@dataclass(slots=True)
class SlotKVCacheConfig:
    """conf/engine/kv_cache/slots.yaml: `num_slots` slots (None = max_num_seqs) of `max_len` tokens
    (clamped to the model's context)."""

    max_len: int = 2048
    num_slots: int | None = None
    attention: str = "native"

    def build_manager(self, max_model_len: int, max_num_seqs: int, bytes_per_token: int,
                      device: torch.device) -> SlotKVCacheManager:
        num_slots = self.num_slots or max_num_seqs
        if num_slots < 1 or self.max_len < 1:
            raise LabError(f"slots need num_slots >= 1 and max_len >= 1, got {num_slots} and {self.max_len}",
                           "set engine.kv_cache.num_slots / max_len to positive integers")
        return SlotKVCacheManager(num_slots, min(self.max_len, max_model_len))
