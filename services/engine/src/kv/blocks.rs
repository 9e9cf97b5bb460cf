//! Paged KV-cache bookkeeping: a bitmap page allocator, reference counts, block tables,
//! copy-on-write, prefix caching by page hash and budget-aware reservations.
//!
//! This module owns only metadata (which page belongs to which sequence); the bytes live
//! in [`crate::kv::KvCache`], owned by the executor. The scheduler tells the
//! executor which pages to copy (copy-on-write) before each step.
//!
//! Accounting: `available = free pages + evictable cached pages − outstanding reservations`.
//! A sequence is admitted only when its whole worst case
//! `ceil((prompt + max_new_tokens) / page_size)` (minus pages it shares through the
//! prefix cache) fits, so a running sequence can never run out of pages.

use std::collections::{HashMap, VecDeque};

pub type PageId = u32;
pub type SeqId = u64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("not enough KV pages: need {need}, available {available}")]
    NoCapacity { need: usize, available: usize },
    #[error("sequence {0} is unknown to the block manager")]
    UnknownSeq(SeqId),
    #[error("sequence {0} is already registered")]
    DuplicateSeq(SeqId),
    #[error("sequence {seq} exceeded its reservation of {reserved} tokens")]
    OverReservation { seq: SeqId, reserved: usize },
}

/// A bitmap of free pages, one bit per page (1 = free).
#[derive(Debug, Clone)]
pub struct PageBitmap {
    words: Vec<u64>,
    len: usize,
    free: usize,
}

impl PageBitmap {
    pub fn new_all_free(len: usize) -> Self {
        let mut words = vec![u64::MAX; len.div_ceil(64)];
        if !len.is_multiple_of(64) {
            if let Some(last) = words.last_mut() {
                *last = (1u64 << (len % 64)) - 1;
            }
        }
        Self {
            words,
            len,
            free: len,
        }
    }

    pub fn free_count(&self) -> usize {
        self.free
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_free(&self, page: PageId) -> bool {
        let p = page as usize;
        self.words[p / 64] & (1 << (p % 64)) != 0
    }

    /// Lowest free page, marked used.
    pub fn alloc(&mut self) -> Option<PageId> {
        for (i, w) in self.words.iter_mut().enumerate() {
            if *w != 0 {
                let bit = w.trailing_zeros() as usize;
                *w &= !(1u64 << bit);
                self.free -= 1;
                return Some((i * 64 + bit) as PageId);
            }
        }
        None
    }

    pub fn release(&mut self, page: PageId) {
        let p = page as usize;
        debug_assert!(!self.is_free(page), "double free of page {page}");
        self.words[p / 64] |= 1 << (p % 64);
        self.free += 1;
    }
}

#[derive(Debug, Clone)]
struct SeqBlocks {
    table: Vec<PageId>,
    /// Tokens whose KV slots are assigned.
    num_tokens: usize,
    /// Pages this sequence may still take from the pool without re-checking capacity.
    reserved_pages: usize,
    /// Pages held for sequences to be forked from this one (`n > 1`), released into their
    /// own reservations by [`BlockManager::fork`].
    held_for_forks: usize,
    /// Hash chain of full pages (for prefix caching), parallel to `table`.
    hashes: Vec<u64>,
    /// Where the hash chain starts: the prefix-cache partition (0: shared).
    salt: u64,
}

/// Where a token's K/V goes: page and offset inside the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub page: PageId,
    pub offset: usize,
}

/// What `append` asks the executor to do before it writes the new tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppendOutcome {
    pub slots: Vec<Slot>,
    /// Copy-on-write: copy page `.0` into page `.1` (all layers) first.
    pub copies: Vec<(PageId, PageId)>,
}

#[derive(Debug)]
pub struct BlockManager {
    page_size: usize,
    bitmap: PageBitmap,
    refcount: Vec<u32>,
    /// Tokens stored in each page (for fragmentation).
    fill: Vec<u32>,
    /// Content hash of a full, cached page.
    page_hash: Vec<Option<u64>>,
    cached: HashMap<u64, PageId>,
    /// Cached pages nobody references, oldest first: reusable by the prefix cache, or
    /// evicted when the free bitmap runs dry.
    evictable: VecDeque<PageId>,
    reserved_total: usize,
    seqs: HashMap<SeqId, SeqBlocks>,
    prefix_caching: bool,
    pub stats: BlockStats,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockStats {
    pub prefix_hits: u64,
    pub allocs: u64,
    pub frees: u64,
    pub evictions: u64,
    pub cow_copies: u64,
}

/// The prefix-cache partition of a `cache_salt` string: never 0 (the shared partition).
pub fn salt_of(salt: &str) -> u64 {
    let d = md5::compute(salt.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&d.0[..8]);
    u64::from_le_bytes(b) | 1
}

/// Hash of a full page's tokens chained to its predecessor's hash (the first page's
/// predecessor is the sequence's prefix-cache salt).
pub fn page_hash(prev: u64, tokens: &[u32]) -> u64 {
    // FNV-1a over (prev, tokens): stable across runs and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    };
    prev.to_le_bytes().into_iter().for_each(&mut eat);
    for t in tokens {
        t.to_le_bytes().into_iter().for_each(&mut eat);
    }
    h
}

impl BlockManager {
    pub fn new(num_pages: usize, page_size: usize, prefix_caching: bool) -> Self {
        Self {
            page_size,
            bitmap: PageBitmap::new_all_free(num_pages),
            refcount: vec![0; num_pages],
            fill: vec![0; num_pages],
            page_hash: vec![None; num_pages],
            cached: HashMap::new(),
            evictable: VecDeque::new(),
            reserved_total: 0,
            seqs: HashMap::new(),
            prefix_caching,
            stats: BlockStats::default(),
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_pages(&self) -> usize {
        self.bitmap.len()
    }

    /// Pages a new sequence could still claim.
    pub fn available(&self) -> usize {
        (self.bitmap.free_count() + self.evictable.len()).saturating_sub(self.reserved_total)
    }

    /// Pages referenced by at least one sequence.
    pub fn used_pages(&self) -> usize {
        self.num_pages() - self.bitmap.free_count() - self.evictable.len()
    }

    pub fn free_pages(&self) -> usize {
        self.num_pages() - self.used_pages()
    }

    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// (allocated capacity − tokens stored) / allocated capacity over referenced pages;
    /// 0 when nothing is allocated.
    pub fn fragmentation(&self) -> f64 {
        let mut cap = 0usize;
        let mut stored = 0usize;
        for (p, &rc) in self.refcount.iter().enumerate() {
            if rc > 0 {
                cap += self.page_size;
                stored += self.fill[p] as usize;
            }
        }
        if cap == 0 {
            0.0
        } else {
            (cap - stored) as f64 / cap as f64
        }
    }

    pub fn block_table(&self, seq: SeqId) -> Option<&[PageId]> {
        self.seqs.get(&seq).map(|s| s.table.as_slice())
    }

    pub fn num_tokens(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.num_tokens)
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Full pages of `prompt` already cached, leaving at least one token to compute.
    fn prefix_hits(&self, prompt: &[u32], salt: u64) -> Vec<(PageId, u64)> {
        let mut hits = Vec::new();
        if !self.prefix_caching || prompt.len() < 2 {
            return hits;
        }
        let mut prev = salt;
        for chunk in prompt[..prompt.len() - 1].chunks_exact(self.page_size) {
            let h = page_hash(prev, chunk);
            match self.cached.get(&h) {
                Some(&p) => hits.push((p, h)),
                None => break,
            }
            prev = h;
        }
        hits
    }

    /// Whether `admit` would succeed now.
    pub fn can_admit(&self, prompt: &[u32], max_new_tokens: usize) -> bool {
        self.can_admit_forks(prompt, max_new_tokens, 0, 0)
    }

    /// [`can_admit`](Self::can_admit) for a sequence that will fork `forks` more once its
    /// prompt is computed.
    /// `salt`: the prefix-cache partition (0: shared).
    pub fn can_admit_forks(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        forks: usize,
        salt: u64,
    ) -> bool {
        let (need, available) = self.admission_need(prompt, max_new_tokens, salt);
        need + forks * self.fork_need_bound(prompt.len(), max_new_tokens) <= available
    }

    /// The most pages one fork of a sequence with `prompt_len` computed tokens can need:
    /// its own new pages, plus a copy of the shared partial last page for it and for the
    /// parent.
    fn fork_need_bound(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        self.pages_for(prompt_len + max_new_tokens) - prompt_len / self.page_size + 2
    }

    fn admission_need(&self, prompt: &[u32], max_new_tokens: usize, salt: u64) -> (usize, usize) {
        let hits = self.prefix_hits(prompt, salt);
        let total = self.pages_for(prompt.len() + max_new_tokens);
        let need = total - hits.len();
        let evictable_hits = hits
            .iter()
            .filter(|(p, _)| self.refcount[*p as usize] == 0)
            .count();
        let available = (self.bitmap.free_count() + self.evictable.len() - evictable_hits)
            .saturating_sub(self.reserved_total);
        (need, available)
    }

    /// Reserve the worst case for a new sequence and attach cached prefix pages.
    /// Returns how many prompt tokens are already in the cache (need no compute).
    pub fn admit(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        max_new_tokens: usize,
    ) -> Result<usize, BlockError> {
        self.admit_forks(seq, prompt, max_new_tokens, 0, 0)
    }

    /// [`admit`](Self::admit), also holding room for `forks` sequences to be forked from
    /// this one once its prompt is computed (parallel sampling shares the prompt's pages).
    /// `salt`: the prefix-cache partition whose pages it may share and fill (0: shared).
    pub fn admit_forks(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        max_new_tokens: usize,
        forks: usize,
        salt: u64,
    ) -> Result<usize, BlockError> {
        if self.seqs.contains_key(&seq) {
            return Err(BlockError::DuplicateSeq(seq));
        }
        let (need, available) = self.admission_need(prompt, max_new_tokens, salt);
        let held = forks * self.fork_need_bound(prompt.len(), max_new_tokens);
        if need + held > available {
            return Err(BlockError::NoCapacity {
                need: need + held,
                available,
            });
        }
        let hits = self.prefix_hits(prompt, salt);
        let mut table = Vec::with_capacity(self.pages_for(prompt.len() + max_new_tokens));
        let mut hashes = Vec::with_capacity(table.capacity());
        for (p, h) in &hits {
            if self.refcount[*p as usize] == 0 {
                self.evictable.retain(|e| e != p);
            }
            self.refcount[*p as usize] += 1;
            table.push(*p);
            hashes.push(*h);
        }
        self.stats.prefix_hits += hits.len() as u64;
        self.reserved_total += need + held;
        let cached_tokens = hits.len() * self.page_size;
        self.seqs.insert(
            seq,
            SeqBlocks {
                table,
                num_tokens: cached_tokens,
                reserved_pages: need,
                held_for_forks: held,
                hashes,
                salt,
            },
        );
        Ok(cached_tokens)
    }

    fn take_page(&mut self) -> PageId {
        let page = match self.bitmap.alloc() {
            Some(p) => p,
            None => {
                // The reservation guarantees a page exists: reuse the oldest cached one.
                let p = self
                    .evictable
                    .pop_front()
                    .expect("reservation guarantees a page");
                if let Some(h) = self.page_hash[p as usize].take() {
                    self.cached.remove(&h);
                }
                self.stats.evictions += 1;
                p
            }
        };
        self.refcount[page as usize] = 1;
        self.fill[page as usize] = 0;
        self.stats.allocs += 1;
        page
    }

    /// Assign slots for `n` more tokens of `seq`, allocating pages from its reservation and
    /// copying a shared last page first (copy-on-write).
    pub fn append(&mut self, seq: SeqId, n: usize) -> Result<AppendOutcome, BlockError> {
        let page_size = self.page_size;
        let s = self.seqs.get(&seq).ok_or(BlockError::UnknownSeq(seq))?;
        let mut out = AppendOutcome::default();
        let start = s.num_tokens;
        let new_pages = self.pages_for(start + n).saturating_sub(s.table.len());
        let needs_cow = start % page_size != 0
            && s.table
                .last()
                .is_some_and(|&p| self.refcount[p as usize] > 1);
        if new_pages + usize::from(needs_cow) > s.reserved_pages {
            return Err(BlockError::OverReservation {
                seq,
                reserved: s.reserved_pages,
            });
        }
        if needs_cow {
            let old = *s.table.last().expect("checked non-empty");
            let new = self.take_page();
            self.fill[new as usize] = self.fill[old as usize];
            self.refcount[old as usize] -= 1;
            self.stats.cow_copies += 1;
            out.copies.push((old, new));
            let s = self.seqs.get_mut(&seq).expect("present");
            *s.table.last_mut().expect("non-empty") = new;
            s.reserved_pages -= 1;
            self.reserved_total -= 1;
        }
        for _ in 0..new_pages {
            let p = self.take_page();
            let s = self.seqs.get_mut(&seq).expect("present");
            s.table.push(p);
            s.reserved_pages -= 1;
            self.reserved_total -= 1;
        }
        let s = self.seqs.get_mut(&seq).expect("present");
        for pos in start..start + n {
            let page = s.table[pos / page_size];
            out.slots.push(Slot {
                page,
                offset: pos % page_size,
            });
            self.fill[page as usize] = self.fill[page as usize].max((pos % page_size + 1) as u32);
        }
        s.num_tokens = start + n;
        Ok(out)
    }

    /// Register the sequence's newly full pages in the prefix cache. `tokens` are all the
    /// sequence's tokens whose KV has been written.
    pub fn commit(&mut self, seq: SeqId, tokens: &[u32]) {
        if !self.prefix_caching {
            return;
        }
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let full = tokens.len().min(s.num_tokens) / self.page_size;
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let prev = if i == 0 { s.salt } else { s.hashes[i - 1] };
            let h = page_hash(prev, &tokens[i * self.page_size..(i + 1) * self.page_size]);
            s.hashes.push(h);
            let page = s.table[i];
            if self.page_hash[page as usize].is_none() && !self.cached.contains_key(&h) {
                self.page_hash[page as usize] = Some(h);
                self.cached.insert(h, page);
            }
        }
    }

    /// Share all of `parent`'s pages with a new sequence `child` (parallel sampling); the
    /// child reserves room for `max_new_tokens` more tokens. Writes copy on demand.
    pub fn fork(
        &mut self,
        parent: SeqId,
        child: SeqId,
        max_new_tokens: usize,
    ) -> Result<(), BlockError> {
        if self.seqs.contains_key(&child) {
            return Err(BlockError::DuplicateSeq(child));
        }
        let p = self
            .seqs
            .get(&parent)
            .ok_or(BlockError::UnknownSeq(parent))?
            .clone();
        // Room held at admission for this fork goes back to the pool first (the fork then
        // reserves exactly what it needs, never more than what was held).
        let release = self
            .fork_need_bound(p.num_tokens, max_new_tokens)
            .min(p.held_for_forks);
        if let Some(ps) = self.seqs.get_mut(&parent) {
            ps.held_for_forks -= release;
        }
        self.reserved_total -= release;
        // A shared, partially filled last page is copied by whichever sequence writes to
        // it first: both get one extra page of reservation for that copy.
        let partial = usize::from(p.num_tokens % self.page_size != 0);
        let child_need = self.pages_for(p.num_tokens + max_new_tokens) - p.table.len() + partial;
        let need = child_need + partial;
        let available = self.available();
        if need > available {
            return Err(BlockError::NoCapacity { need, available });
        }
        for &page in &p.table {
            self.refcount[page as usize] += 1;
        }
        self.reserved_total += need;
        if let Some(ps) = self.seqs.get_mut(&parent) {
            ps.reserved_pages += partial;
        }
        self.seqs.insert(
            child,
            SeqBlocks {
                table: p.table,
                num_tokens: p.num_tokens,
                reserved_pages: child_need,
                held_for_forks: 0,
                hashes: p.hashes,
                salt: p.salt,
            },
        );
        Ok(())
    }

    /// Release everything `seq` holds: pages drop a reference (cached ones become
    /// evictable, others free) and the unused reservation returns to the pool.
    pub fn free(&mut self, seq: SeqId) -> bool {
        let Some(s) = self.seqs.remove(&seq) else {
            return false;
        };
        self.reserved_total -= s.reserved_pages + s.held_for_forks;
        for &page in s.table.iter().rev() {
            let rc = &mut self.refcount[page as usize];
            *rc -= 1;
            if *rc == 0 {
                self.stats.frees += 1;
                if self.page_hash[page as usize].is_some() {
                    self.evictable.push_back(page);
                } else {
                    self.fill[page as usize] = 0;
                    self.bitmap.release(page);
                }
            }
        }
        true
    }

    /// Internal consistency check used by tests: every page is exactly one of free,
    /// evictable or referenced, and reservations add up.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counted = vec![0u32; self.num_pages()];
        for s in self.seqs.values() {
            for &p in &s.table {
                counted[p as usize] += 1;
            }
        }
        for (p, &held) in counted.iter().enumerate() {
            let free = self.bitmap.is_free(p as PageId);
            let evictable = self.evictable.contains(&(p as PageId));
            let rc = self.refcount[p];
            if rc != held {
                return Err(format!("page {p}: refcount {rc} but {held} tables hold it"));
            }
            let states = usize::from(free) + usize::from(evictable) + usize::from(rc > 0);
            if states != 1 {
                return Err(format!(
                    "page {p}: free={free} evictable={evictable} rc={rc}"
                ));
            }
        }
        let reserved: usize = self
            .seqs
            .values()
            .map(|s| s.reserved_pages + s.held_for_forks)
            .sum();
        if reserved != self.reserved_total {
            return Err(format!(
                "reserved {reserved} != total {}",
                self.reserved_total
            ));
        }
        if self.reserved_total > self.bitmap.free_count() + self.evictable.len() {
            return Err("over-committed: reservations exceed free pages".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bitmap_hands_out_each_page_once() {
        let mut b = PageBitmap::new_all_free(130);
        let mut seen = std::collections::HashSet::new();
        while let Some(p) = b.alloc() {
            assert!(seen.insert(p));
        }
        assert_eq!(seen.len(), 130);
        b.release(77);
        assert_eq!(b.alloc(), Some(77));
    }

    #[test]
    fn fragmentation_formula() {
        let mut bm = BlockManager::new(8, 16, false);
        assert_eq!(bm.fragmentation(), 0.0);
        bm.admit(1, &[1; 20], 12).unwrap();
        bm.append(1, 20).unwrap();
        // 2 pages = 32 slots, 20 stored
        assert!((bm.fragmentation() - 12.0 / 32.0).abs() < 1e-12);
        bm.append(1, 12).unwrap();
        assert_eq!(bm.fragmentation(), 0.0);
        bm.free(1);
        assert_eq!(bm.used_pages(), 0);
    }

    #[test]
    fn room_held_for_forks_is_used_by_them_and_returned() {
        let mut bm = BlockManager::new(16, 4, true);
        let prompt: Vec<u32> = (0..10).collect();
        // 10 + 6 tokens: 4 pages for the parent; each fork at most 4 - 2 + 2.
        assert!(bm.can_admit_forks(&prompt, 6, 3, 0));
        assert!(!bm.can_admit_forks(&prompt, 6, 4, 0), "4 + 4·4 > 16 pages");
        bm.admit_forks(1, &prompt, 6, 2, 0).unwrap();
        assert_eq!(bm.available(), 16 - 4 - 8);
        bm.append(1, 10).unwrap();
        bm.fork(1, 2, 6).unwrap();
        bm.fork(1, 3, 6).unwrap();
        bm.check_invariants().unwrap();
        // The prompt's 3 pages are shared: 3 in use, not 9.
        assert_eq!(bm.used_pages(), 3);
        for s in [2, 3, 1] {
            bm.append(s, 1).unwrap();
            bm.check_invariants().unwrap();
        }
        for s in [1, 2, 3] {
            bm.free(s);
        }
        bm.check_invariants().unwrap();
        assert_eq!(bm.available(), 16);
        // A parent that ends before forking returns what it held.
        bm.admit_forks(4, &prompt, 6, 2, 0).unwrap();
        bm.free(4);
        assert_eq!(bm.available(), 16);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn prefix_cache_shares_full_pages_and_cow_on_fork() {
        let mut bm = BlockManager::new(16, 4, true);
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(bm.admit(1, &prompt, 2).unwrap(), 0);
        bm.append(1, 10).unwrap();
        bm.commit(1, &prompt);
        // Same prompt: the two full pages are hits, 2 tokens remain to compute.
        assert_eq!(bm.admit(2, &prompt, 2).unwrap(), 8);
        assert_eq!(bm.block_table(2).unwrap(), &bm.block_table(1).unwrap()[..2]);
        bm.check_invariants().unwrap();
        // Fork: the partially filled last page is shared, writing copies it.
        bm.fork(1, 3, 4).unwrap();
        let out = bm.append(3, 1).unwrap();
        assert_eq!(out.copies.len(), 1);
        assert_eq!(out.copies[0].0, bm.block_table(1).unwrap()[2]);
        assert_ne!(bm.block_table(3).unwrap()[2], bm.block_table(1).unwrap()[2]);
        bm.check_invariants().unwrap();
        for s in [1, 2, 3] {
            bm.free(s);
        }
        bm.check_invariants().unwrap();
        assert_eq!(bm.used_pages(), 0);
        // The cached pages stay reusable after their owners left.
        assert_eq!(bm.admit(4, &prompt, 2).unwrap(), 8);
        bm.free(4);
        assert_eq!(bm.available(), 16);
    }

    #[test]
    fn prefix_cache_pages_are_shared_only_within_a_salt() {
        let mut bm = BlockManager::new(16, 4, true);
        let prompt: Vec<u32> = (0..10).collect();
        let (a, b) = (salt_of("tenant-a"), salt_of("tenant-b"));
        assert_ne!(a, b);
        assert_ne!(a, 0);
        assert_eq!(bm.admit_forks(1, &prompt, 2, 0, a).unwrap(), 0);
        bm.append(1, 10).unwrap();
        bm.commit(1, &prompt);
        // Another tenant, and the shared partition, compute the prompt themselves.
        assert_eq!(bm.admit_forks(2, &prompt, 2, 0, b).unwrap(), 0);
        assert_eq!(bm.admit(3, &prompt, 2).unwrap(), 0);
        // The same tenant hits its own pages.
        assert_eq!(bm.admit_forks(4, &prompt, 2, 0, a).unwrap(), 8);
        for s in [1, 2, 3, 4] {
            bm.free(s);
        }
        bm.check_invariants().unwrap();
        assert_eq!(bm.available(), 16);
    }

    #[test]
    fn admission_refuses_over_commit() {
        let mut bm = BlockManager::new(4, 16, false);
        bm.admit(1, &[0; 30], 2).unwrap(); // 2 pages
        assert!(!bm.can_admit(&[0; 40], 0)); // needs 3
        assert!(matches!(
            bm.admit(2, &[0; 40], 0),
            Err(BlockError::NoCapacity {
                need: 3,
                available: 2
            })
        ));
        bm.admit(2, &[0; 20], 10).unwrap();
        assert_eq!(bm.available(), 0);
        bm.free(1);
        assert_eq!(bm.available(), 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Admit {
            len: usize,
            max_new: usize,
            prefix: bool,
        },
        Step(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..60, 1usize..30, any::<bool>()).prop_map(|(len, max_new, prefix)| Op::Admit {
                len,
                max_new,
                prefix
            }),
            (0usize..8).prop_map(Op::Step),
            (0usize..8).prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// A random workload never hands out a page twice, never over-commits, and every
        /// page comes back when all sequences end.
        #[test]
        fn random_workload_keeps_invariants(ops in proptest::collection::vec(op(), 1..80), page_size in 1usize..9, pages in 4usize..40) {
            let mut bm = BlockManager::new(pages, page_size, true);
            // seq -> (tokens so far, prompt len + max_new)
            let mut live: Vec<(SeqId, Vec<u32>, usize)> = Vec::new();
            let mut next: SeqId = 0;
            for op in ops {
                match op {
                    Op::Admit { len, max_new, prefix } => {
                        let prompt: Vec<u32> = (0..len as u32).map(|i| if prefix { i % 7 } else { i + next as u32 * 100 }).collect();
                        let can = bm.can_admit(&prompt, max_new);
                        match bm.admit(next, &prompt, max_new) {
                            Ok(cached) => {
                                prop_assert!(can);
                                let rest = prompt.len() - cached;
                                bm.append(next, rest).unwrap();
                                bm.commit(next, &prompt);
                                live.push((next, prompt, len + max_new));
                            }
                            Err(BlockError::NoCapacity { .. }) => prop_assert!(!can),
                            Err(e) => prop_assert!(false, "{e}"),
                        }
                        next += 1;
                    }
                    Op::Step(i) => {
                        if let Some((seq, toks, limit)) = live.get_mut(i) {
                            if toks.len() < *limit {
                                // never fails: the reservation covers it
                                bm.append(*seq, 1).unwrap();
                                toks.push(9);
                                bm.commit(*seq, toks);
                            }
                        }
                    }
                    Op::Free(i) => {
                        if i < live.len() {
                            let (seq, _, _) = live.remove(i);
                            prop_assert!(bm.free(seq));
                        }
                    }
                }
                bm.check_invariants().map_err(TestCaseError::fail)?;
                let f = bm.fragmentation();
                prop_assert!((0.0..=1.0).contains(&f));
            }
            for (seq, _, _) in live {
                bm.free(seq);
            }
            bm.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(bm.used_pages(), 0);
            prop_assert_eq!(bm.available(), pages);
        }
    }
}
