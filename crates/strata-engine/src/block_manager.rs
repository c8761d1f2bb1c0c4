//! The KV block manager: fixed-size cache blocks with reference counts, one block table per
//! sequence, and automatic prefix caching (full blocks named by a hash chained over their tokens).

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

/// Index of a block in the paged KV cache.
pub type BlockId = u32;

/// No block could be found for a sequence: the caller preempts or waits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of KV cache blocks: {needed} needed, {available} available")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub available: usize,
}

/// The blocks of one sequence, in position order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV the blocks hold or will hold after the current step.
    pub num_tokens: usize,
    /// Hash chain value of each full block registered so far.
    hashes: Vec<u64>,
}

impl BlockTable {
    /// Block ids as the forward pass wants them.
    pub fn ids(&self) -> &[BlockId] {
        &self.blocks
    }
}

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    ref_count: u32,
    /// Content hash once the block is full and registered in the prefix cache.
    hash: Option<u64>,
    last_used: u64,
}

/// Owner of all KV blocks.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    meta: Vec<BlockMeta>,
    /// Blocks with no user and no cached content.
    free: Vec<BlockId>,
    /// Blocks with no user whose content is cached, oldest use first: `(last_used, id)`.
    evictable: BTreeSet<(u64, BlockId)>,
    /// Content hash -> block holding it (in use or evictable).
    cached: HashMap<u64, BlockId>,
    clock: u64,
    hits: u64,
    lookups: u64,
}

/// Hash of a full block given the hash of the block before it.
fn chain_hash(prev: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockManager {
    /// `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> BlockManager {
        BlockManager {
            block_size: block_size.max(1),
            prefix_caching,
            meta: vec![BlockMeta::default(); num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeSet::new(),
            cached: HashMap::new(),
            clock: 0,
            hits: 0,
            lookups: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// All blocks.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks that can be handed out now (free or evictable).
    pub fn num_available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks in use by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_available()
    }

    /// Fraction of full prompt blocks found in the prefix cache so far.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }

    /// References held on `block` (for invariant checks and metrics).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.meta[block as usize].ref_count
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Takes a block for exclusive use: a free one, else the least recently used cached one.
    fn take_block(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                if let Some(h) = self.meta[id as usize].hash.take() {
                    self.cached.remove(&h);
                }
                id
            }
        };
        let now = self.tick();
        let m = &mut self.meta[id as usize];
        m.ref_count = 1;
        m.last_used = now;
        Some(id)
    }

    /// Blocks needed for a prompt of `len` tokens, at most (before prefix-cache hits).
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// A table for `prompt`, reusing cached full blocks of its prefix. Returns the table and
    /// how many leading tokens already have their KV in the cache (never the whole prompt:
    /// the last token is always computed, so no shared block is ever written).
    pub fn allocate_prompt(&mut self, prompt: &[u32]) -> Result<(BlockTable, usize), OutOfBlocks> {
        let bs = self.block_size;
        let mut table = BlockTable {
            num_tokens: prompt.len(),
            ..Default::default()
        };
        let reusable_blocks = if self.prefix_caching {
            prompt.len().saturating_sub(1) / bs
        } else {
            0
        };
        let mut prev = 0u64;
        for chunk in prompt.chunks_exact(bs).take(reusable_blocks) {
            let h = chain_hash(prev, chunk);
            self.lookups += 1;
            let Some(&id) = self.cached.get(&h) else { break };
            self.hits += 1;
            let now = self.tick();
            let m = &mut self.meta[id as usize];
            if m.ref_count == 0 {
                self.evictable.remove(&(m.last_used, id));
            }
            m.ref_count += 1;
            m.last_used = now;
            table.blocks.push(id);
            table.hashes.push(h);
            prev = h;
        }
        let cached_tokens = table.blocks.len() * bs;
        let needed = self.blocks_for(prompt.len()) - table.blocks.len();
        if needed > self.num_available() {
            let available = self.num_available();
            self.free_table(&mut table);
            return Err(OutOfBlocks { needed, available });
        }
        for _ in 0..needed {
            let id = self.take_block().expect("availability was checked");
            table.blocks.push(id);
        }
        Ok((table, cached_tokens))
    }

    /// Makes room in `table` for `n` more tokens (allocating blocks as needed). On failure
    /// nothing changes.
    pub fn grow(&mut self, table: &mut BlockTable, n: usize) -> Result<(), OutOfBlocks> {
        let needed = self.blocks_for(table.num_tokens + n).saturating_sub(table.blocks.len());
        if needed > self.num_available() {
            return Err(OutOfBlocks {
                needed,
                available: self.num_available(),
            });
        }
        for _ in 0..needed {
            let id = self.take_block().expect("availability was checked");
            table.blocks.push(id);
        }
        table.num_tokens += n;
        Ok(())
    }

    /// The block a write at `pos` goes to; it must be owned by this table alone.
    pub fn block_for_write(&self, table: &BlockTable, pos: usize) -> BlockId {
        let id = table.blocks[pos / self.block_size];
        debug_assert_eq!(self.meta[id as usize].ref_count, 1, "write into a shared block {id}");
        id
    }

    /// Registers the table's blocks that became full in the prefix cache, given all tokens of
    /// the sequence whose KV is now written (`tokens.len() <= table.num_tokens`).
    pub fn commit_full_blocks(&mut self, table: &mut BlockTable, tokens: &[u32]) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let full = (tokens.len() / bs).min(table.blocks.len());
        while table.hashes.len() < full {
            let i = table.hashes.len();
            let prev = if i == 0 { 0 } else { table.hashes[i - 1] };
            let h = chain_hash(prev, &tokens[i * bs..(i + 1) * bs]);
            table.hashes.push(h);
            let id = table.blocks[i];
            if self.meta[id as usize].hash.is_none() && !self.cached.contains_key(&h) {
                self.meta[id as usize].hash = Some(h);
                self.cached.insert(h, id);
            }
        }
    }

    /// Releases every block of `table` (finish, abort or preemption) and empties it.
    pub fn free_table(&mut self, table: &mut BlockTable) {
        let now = self.tick();
        // Last blocks first, so the LRU evicts a sequence's tail before its shared prefix.
        for &id in table.blocks.iter().rev() {
            self.release_block(id, now);
        }
        table.blocks.clear();
        table.hashes.clear();
        table.num_tokens = 0;
    }

    /// Shrinks `table` to its first `num_tokens` tokens (rejected draft tokens), releasing the
    /// blocks past them. Blocks registered in the prefix cache are never cut into: the table
    /// keeps at least the tokens they hold.
    pub fn truncate(&mut self, table: &mut BlockTable, num_tokens: usize) {
        let num_tokens = num_tokens
            .max(table.hashes.len() * self.block_size)
            .min(table.num_tokens);
        let keep = self.blocks_for(num_tokens);
        let now = self.tick();
        while table.blocks.len() > keep {
            let id = table.blocks.pop().expect("more blocks than kept");
            self.release_block(id, now);
        }
        table.num_tokens = num_tokens;
    }

    /// Drops one reference to `block`; with none left it becomes evictable (cached content) or free.
    fn release_block(&mut self, id: BlockId, now: u64) {
        let m = &mut self.meta[id as usize];
        assert!(m.ref_count > 0, "block {id} freed twice");
        m.ref_count -= 1;
        if m.ref_count == 0 {
            if m.hash.is_some() {
                m.last_used = now;
                self.evictable.insert((now, id));
            } else {
                self.free.push(id);
            }
        }
    }

    /// Checks the bookkeeping: each block is free, evictable or referenced, exactly once.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.meta.len()];
        for &id in &self.free {
            seen[id as usize] += 1;
            if self.meta[id as usize].ref_count != 0 || self.meta[id as usize].hash.is_some() {
                return Err(format!("free block {id} is referenced or cached"));
            }
        }
        for &(t, id) in &self.evictable {
            seen[id as usize] += 1;
            let m = &self.meta[id as usize];
            if m.ref_count != 0 || m.hash.is_none() || m.last_used != t {
                return Err(format!("evictable block {id} is inconsistent: {m:?}"));
            }
        }
        for (id, m) in self.meta.iter().enumerate() {
            if m.ref_count > 0 {
                seen[id] += 1;
            }
            if seen[id] != 1 {
                return Err(format!("block {id} is in {} states at once", seen[id]));
            }
            if let Some(h) = m.hash {
                if self.cached.get(&h) != Some(&(id as BlockId)) {
                    return Err(format!("block {id} has a hash the cache does not map to it"));
                }
            }
        }
        Ok(())
    }
}
