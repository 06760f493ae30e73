"""Block accounting for the scheduler: admission, growth, release and the prefix cache. Pure Python.

Prefix cache: every full block of a sequence whose KV matches its tokens one-to-one is keyed by (parent key, token
ids) (kv/prefix_chain.py), with the chain rooted in the tenant and the arena's storage (`storage_key`: dtype, bits,
group size; with a disk tier also the model's identity), so a prefix never crosses tenants and blocks of different
storage are never mixed. With a disk tier (`disk`, engine/disk_prefix.py) a chain continues on disk where the RAM
hits end: those blocks are read back instead of recomputed, and every block entering the cache is queued for disk. The cache
holds its own reference on each registered block, so (a) any later write to it goes through copy-on-write and
(b) it survives the sequence that computed it; those pool-only blocks are reclaimed, least recently used first,
when an allocation would otherwise fail.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

from cortexstream.engine.disk_prefix import DiskPrefix, Restored
from cortexstream.engine.sequence import Sequence
from cortexstream.kv.allocator import BlockAllocator
from cortexstream.kv.prefix_chain import chain_next, chain_root


# Blocks a sequence that outgrew its reservation takes at once (a run of 8 x 16 tokens), so decode growth keeps
# the table one contiguous run where the arena allows; unused ones go back on finish or on demand.
_RUN_AHEAD_BLOCKS = 8


@dataclass(frozen=True)
class _CachedBlock:
    block: int
    tokens: tuple[int, ...]


class BlockManager:
    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_caching: bool = True,
                 storage_key: str = "", disk: DiskPrefix | None = None) -> None:
        self.allocator = allocator
        self.disk = disk
        self.storage_key = storage_key  # how the arena stores a block (`ArenaConfig.cache_key`)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._by_hash: dict[int, _CachedBlock] = {}
        self._lru: OrderedDict[int, int] = OrderedDict()  # block -> hash, oldest first
        self.num_prefix_hits = 0
        # Prompt blocks that an admitted sequence is about to compute: hash -> owner. A waiting sequence whose
        # next block is among them waits for it instead of computing the same KV a second time.
        self._pending: dict[int, int] = {}
        self._pending_by_owner: dict[int, list[int]] = {}
        # Sequences holding blocks reserved ahead of their length (owner -> sequence): given back on demand.
        self._holders: dict[int, Sequence] = {}
        self.reserve_ahead = True
        self._copies: list[tuple[int, int]] = []  # copy-on-write pairs planned, not yet handed to the runner
        self._step_need: dict[int, int] = {}  # owner -> KV slots reserved for this step (never trimmed before it)

    # --- sizes ------------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    def cached_block_ids(self) -> list[int]:
        """The blocks the prefix cache holds a reference to, least recently used first."""
        return list(self._lru)

    def blocks_on_disk(self) -> list[int]:
        """The cached blocks whose KV the disk tier holds too (written, or queued to be)."""
        if self.disk is None:
            return []
        return [block for block, key in self._lru.items() if self.disk.store.contains(key)]

    def num_reclaimable(self) -> int:
        return sum(1 for block in self._lru if self.allocator.ref_count(block) == 1)

    # --- prefix cache -----------------------------------------------------------------------------------------
    def prefix_root(self, tenant: str | None) -> int:
        """The salt a tenant's prefix chains start from in this arena's storage."""
        return chain_root(self.storage_key, tenant)

    def _match(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) of the longest cached chain of full prompt blocks."""
        if not self.prefix_caching:
            return [], []
        blocks: list[int] = []
        hashes: list[int] = []
        for h, tokens in self._chain(seq, 0, len(seq.all_ids) // self.block_size, self.prefix_root(seq.tenant)):
            cached = self._by_hash.get(h)
            if cached is None or cached.tokens != tokens:
                break
            blocks.append(cached.block)
            hashes.append(h)
        return blocks, hashes

    def _chain(self, seq: Sequence, start: int, stop: int, parent: int) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(hash, token ids) of the sequence's full blocks [start, stop), continuing the chain from `parent`;
        lazily, so a caller that stops at the first miss hashes no further."""
        bs, ids = self.block_size, seq.all_ids
        for i in range(start, stop):
            tokens = tuple(ids[i * bs : (i + 1) * bs])
            parent = chain_next(parent, tokens)
            yield parent, tokens

    def waits_for_shared_prefix(self, seq: Sequence) -> bool:
        """True when the next prompt block `seq` would compute is being computed by an admitted sequence: it
        should wait for that block to reach the prefix cache (one prefill of a shared prefix, not one each)."""
        if not self._pending or not self.prefix_caching or not seq.uses_arena:
            return False
        hits, hashes = self._match(seq)
        if (len(hits) + 1) * self.block_size > len(seq.prompt_ids):
            return False
        parent = hashes[-1] if hashes else self.prefix_root(seq.tenant)
        next_hash, _ = next(self._chain(seq, len(hits), len(hits) + 1, parent))
        owner = self._pending.get(next_hash)
        return owner is not None and owner != seq.owner

    def _add_pending(self, seq: Sequence, num_hits: int) -> None:
        parent = seq.block_hashes[-1] if seq.block_hashes else self.prefix_root(seq.tenant)
        hashes = [h for h, _ in self._chain(seq, num_hits, len(seq.prompt_ids) // self.block_size, parent)
                  if h not in self._by_hash and h not in self._pending]
        for h in hashes:
            self._pending[h] = seq.owner
        if hashes:
            self._pending_by_owner[seq.owner] = hashes

    def _drop_pending(self, seq: Sequence) -> None:
        for h in self._pending_by_owner.pop(seq.owner, ()):
            if self._pending.get(h) == seq.owner:
                del self._pending[h]

    def register_full_blocks(self, seq: Sequence) -> None:
        """Add the sequence's newly completed blocks to the prefix cache (only while KV matches tokens 1:1)."""
        if not self.prefix_caching or not seq.kv_from_tokens or seq.num_physical != seq.num_computed:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else self.prefix_root(seq.tenant)
        for i, (h, tokens) in enumerate(self._chain(seq, len(seq.block_hashes), full, parent),
                                        start=len(seq.block_hashes)):
            seq.block_hashes.append(h)
            if self._pending.get(h) == seq.owner:
                del self._pending[h]
            block = seq.block_table[i]
            if h in self._by_hash or block in self._lru:
                continue
            self.allocator.share([block])
            self._by_hash[h] = _CachedBlock(block, tokens)
            self._lru[block] = h
            if self.disk is not None:
                self.disk.queue_write(block, h, tokens)

    def _reclaim(self, num_blocks: int, protect: set[int] = frozenset()) -> int:
        freed = 0
        for block in list(self._lru):
            if freed >= num_blocks:
                break
            if block in protect or self.allocator.ref_count(block) != 1:
                continue
            h = self._lru.pop(block)
            del self._by_hash[h]
            freed += self.allocator.free([block])
        return freed

    def _allocate(self, n: int, owner: int, protect: set[int] = frozenset()) -> list[int]:
        self._make_free(n, protect)
        return self.allocator.allocate(n, owner=owner)

    def _make_free(self, n: int, protect: set[int] = frozenset()) -> None:
        """Try to have `n` free blocks: reclaim unused prefix-cache blocks, then give back reserved tails."""
        short = n - self.allocator.num_free_blocks
        if short > 0:
            short -= self._reclaim(short, protect)
        if short > 0:
            self._trim_reserves(short)

    # --- blocks reserved ahead (runs, so tables stay contiguous; given back on demand) ------------------------
    def _surplus(self, seq: Sequence) -> int:
        """Blocks at the end of the table that no token, pending or next, needs yet."""
        keep = self.blocks_for(max(seq.num_tokens, seq.num_physical, self._step_need.get(seq.owner, 0)) + 1)
        return max(0, len(seq.block_table) - keep)

    def trim_surplus(self, seq: Sequence) -> int:
        """Free the blocks past what `seq` needs (taken for rejected drafts); a reserved run is kept."""
        if seq.owner in self._holders or not seq.uses_arena:
            return 0
        surplus = self._surplus(seq)
        if not surplus:
            return 0
        tail = seq.block_table[len(seq.block_table) - surplus:]
        del seq.block_table[len(seq.block_table) - surplus:]
        return self.allocator.free(tail)

    def num_trimmable(self) -> int:
        return sum(self._surplus(seq) for seq in self._holders.values())

    def _trim_reserves(self, num_blocks: int) -> int:
        freed = 0
        for seq in sorted(self._holders.values(), key=lambda s: s.arrival_time, reverse=True):
            if freed >= num_blocks:
                break
            surplus = min(self._surplus(seq), num_blocks - freed)
            if surplus:
                tail = seq.block_table[len(seq.block_table) - surplus:]
                del seq.block_table[len(seq.block_table) - surplus:]
                freed += self.allocator.free(tail)
        return freed

    def _reserve_run(self, seq: Sequence, need: int, grow_in_place: bool) -> list[int] | None:
        """`need` blocks plus blocks ahead as one contiguous run: at admission all the sequence can reach by
        max_tokens, when growing `_RUN_AHEAD_BLOCKS` more right after its last block. None when no run is free
        (the caller then takes blocks wherever they are)."""
        if not self.reserve_ahead or seq.kv_policy.evicts:
            return None
        reachable = self.blocks_for(seq.max_total_tokens) - len(seq.block_table)
        want = max(need, min(reachable, need + _RUN_AHEAD_BLOCKS) if grow_in_place else reachable)
        for n in dict.fromkeys((want, need)):
            if grow_in_place:
                run = self.allocator.extend_contiguous([seq.block_table[-1]], n, owner=seq.owner)
            elif self.allocator.can_allocate(n, contiguous=True):
                run = self.allocator.allocate(n, owner=seq.owner, contiguous=True)
            else:
                run = None
            if run is not None:
                self._holders[seq.owner] = seq
                return run
        return None

    # --- admission and growth ---------------------------------------------------------------------------------
    def _admission_need(self, seq: Sequence, hits: list[int]) -> int:
        need = self.blocks_for(seq.num_tokens) - len(hits)
        if hits and len(hits) * self.block_size >= seq.num_tokens:
            need += 1  # the last prompt token is recomputed into a shared block: copy-on-write
        return need

    def can_admit(self, seq: Sequence) -> bool:
        """Whether `seq` fits now: free blocks plus reclaimable cached ones (not counting its own hits)."""
        hits, _ = self._match(seq)
        hit_set = set(hits)
        need = self._admission_need(seq, hits) if seq.uses_arena else 0
        if need <= self.allocator.num_free_blocks:
            return True
        reclaimable = sum(1 for b in self._lru if b not in hit_set and self.allocator.ref_count(b) == 1)
        return need <= self.allocator.num_free_blocks + reclaimable + self.num_trimmable()

    def admit(self, seq: Sequence) -> None:
        """Give `seq` its prefix-cache hits plus fresh blocks for the rest. OutOfBlocksError changes nothing."""
        if not seq.uses_arena:  # its KV lives in the caller's cache
            seq.num_computed = seq.num_physical = seq.num_cached_prefix = 0
            return
        hits, hashes = self._match(seq)
        need = self.blocks_for(seq.num_tokens) - len(hits)
        seq.block_table[:] = hits  # so that the reservation counts what the hits already cover
        try:
            fresh = self._reserve_run(seq, need, grow_in_place=False) if need > 0 else []
            if fresh is None:
                fresh = self._allocate(need, seq.owner, protect=set(hits))
        except Exception:
            seq.block_table.clear()
            raise
        self.allocator.share(hits)
        for block in hits:
            self._lru.move_to_end(block)
        seq.block_table[:] = hits + fresh
        seq.block_hashes = list(hashes)
        cached = min(len(hits) * self.block_size, seq.num_tokens - 1)
        seq.num_computed = seq.num_physical = seq.num_cached_prefix = cached
        self.num_prefix_hits += len(hits)
        if self.prefix_caching and seq.kv_from_tokens and seq.hook is None:
            self._add_pending(seq, len(hits))
            self._restore_from_disk(seq, len(hits), fresh)

    def _restore_from_disk(self, seq: Sequence, num_hits: int, fresh: list[int]) -> None:
        """Start reading the blocks that continue the RAM hits' chain on disk into the first fresh blocks."""
        if self.disk is None or not fresh:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else self.prefix_root(seq.tenant)
        stop = min(len(seq.all_ids) // self.block_size, num_hits + len(fresh))
        entries = self.disk.on_disk(self._chain(seq, num_hits, stop, parent))
        if entries:
            self.disk.start(seq, fresh[:len(entries)], entries)

    def restoring(self, seq: Sequence) -> bool:
        """Whether `seq` waits for prefix blocks being read from disk (it takes no prefill work until then)."""
        return self.disk is not None and self.disk.restoring(seq)

    def finish_restores(self) -> list[Restored]:
        """Restores whose reads are done: their sequences now count the restored tokens as computed; the caller
        hands the payloads to the runner, which writes them before anything reads them."""
        if self.disk is None or not self.disk.num_restoring:
            return []
        done = self.disk.finished()
        for restored in done:
            seq = restored.seq
            if restored.blocks:
                cached = min(seq.num_computed + len(restored.blocks) * self.block_size, seq.num_tokens - 1)
                seq.num_computed = seq.num_physical = seq.num_cached_prefix = cached
        return done

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more physical tokens, with a private copy of each shared block the write
        touches (the copy is planned here, `take_copies`, and made by the runner before it writes). A sequence
        whose policy evicts gets every shared block copied, since its eviction rewrites slots from the first one.
        False, with nothing changed, when the blocks cannot be had."""
        if not seq.uses_arena:
            return True
        need = seq.num_physical + num_new_tokens
        self._step_need[seq.owner] = max(need, self._step_need.get(seq.owner, 0))
        bs = self.block_size
        first = 0 if seq.kv_policy.evicts else seq.num_physical // bs
        last = (seq.num_physical + num_new_tokens - 1) // bs
        shared = [i for i in range(first, min(last + 1, len(seq.block_table)))
                  if self.allocator.ref_count(seq.block_table[i]) > 1]
        grow = max(0, last + 1 - len(seq.block_table))
        if grow + len(shared) == 0:
            return True
        run = self._reserve_run(seq, grow, grow_in_place=True) if grow and seq.block_table and not shared else None
        if run is not None:
            seq.block_table.extend(run)
            return True
        need = grow + len(shared)
        if self.allocator.num_free_blocks < need:
            self._make_free(need)
        if self.allocator.num_free_blocks < need:
            return False
        for i in shared:
            block = seq.block_table[i]
            new, copied = self.allocator.copy_on_write(block, owner=seq.owner)
            if copied:
                self._copies.append((block, new))
                seq.block_table[i] = new
        if grow:
            seq.block_table.extend(self.allocator.allocate(grow, owner=seq.owner))
        return True

    def make_writable(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """Private copies of the shared blocks holding slots [start, end) of `seq` (for a write from outside a
        forward pass, e.g. C2C fusion): returns the (source, destination) pairs to copy before writing."""
        bs = self.block_size
        pairs = []
        for i in range(start // bs, min(-(-end // bs), len(seq.block_table))):
            block = seq.block_table[i]
            new, copied = self.allocator.copy_on_write(block, owner=seq.owner)
            if copied:
                pairs.append((block, new))
                seq.block_table[i] = new
        return pairs

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The copy-on-write pairs planned since the last call, in order."""
        copies, self._copies = tuple(self._copies), []
        self._step_need.clear()  # the step is planned: its reservations are in the tables
        return copies

    def set_physical(self, seq: Sequence, num_physical: int) -> int:
        """A policy left `num_physical` slots: record it and free the blocks past them; returns blocks freed."""
        seq.num_physical = num_physical
        used = self.blocks_for(num_physical)
        surplus = seq.block_table[used:]
        if not surplus:
            return 0
        del seq.block_table[used:]
        return self.allocator.free(surplus)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's computed blocks by reference, and its counters and prefix-cache chain."""
        shared = list(parent.block_table[: self.blocks_for(parent.num_physical)])
        self.allocator.share(shared)
        child.block_table[:] = shared
        child.block_hashes = list(parent.block_hashes)
        child.num_computed = parent.num_computed
        child.num_physical = parent.num_physical
        child.num_cached_prefix = parent.num_cached_prefix

    def release(self, seq: Sequence) -> int:
        """Drop the sequence's references; blocks also held by the prefix cache stay cached."""
        self._drop_pending(seq)
        if self.disk is not None:
            self.disk.cancel(seq)
        self._holders.pop(seq.owner, None)
        freed = self.allocator.free(seq.block_table) if seq.block_table else 0
        seq.block_table.clear()
        seq.block_hashes = []
        seq.num_computed = seq.num_physical = 0
        return freed

    # --- forgetting (the TUI's "clear conversation") ----------------------------------------------------------
    def drop_cached(self, owners: "set[int] | frozenset[int] | list[int]") -> int:
        """Remove every prefix-cache entry whose block was allocated by one of `owners` (Sequence.owner ids) and
        drop the cache's reference to it; returns how many blocks became free.

        Cached blocks otherwise outlive their sequence until an allocation reclaims them, so a "clear" in a UI
        would not return them to the arena. Always safe: a block still in some running sequence's table only
        loses its cache entry (that sequence keeps its own reference); the cache is only an optimisation.
        """
        wanted = set(owners)
        doomed = [block for block in self._lru if self.allocator.owner_of(block) in wanted]
        for block in doomed:
            del self._by_hash[self._lru.pop(block)]
        return self.allocator.free(doomed) if doomed else 0
