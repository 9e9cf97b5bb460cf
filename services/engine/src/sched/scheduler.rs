//! Iteration-level (continuous) batching, FCFS, chunked prefill and budget-aware
//! admission. Pure logic: the scheduler actor drives it, tests drive it directly.
//!
//! Every step: running sequences first (in arrival order) — each decode takes one token
//! of the budget, an unfinished prefill takes a chunk of what is left — then waiting
//! requests are admitted in arrival order while `max_num_seqs`, the token budget and the
//! KV pages allow. Admission reserves the sequence's worst case,
//! `ceil((prompt + max_tokens) / page_size)` pages, so a running sequence never runs out
//! of pages and nothing is ever preempted. The queue is strictly FCFS: if the head does
//! not fit, later requests wait behind it (no starvation of long prompts).

use crate::backend::{SeqChunk, StepInput};
use crate::kv::{BlockManager, SeqId};
use crate::precision::StepOutput;
use crate::sched::sampling::{adjust_logits, logprobs, sample};
use crate::trace::SeqTrace;
use quantmesh_types::{FinishReason, SamplingParams, TokenLogprobs};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
}

#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub params: SamplingParams,
    pub eos: Vec<u32>,
    rng: StdRng,
    /// Tokens whose KV is in the cache.
    num_computed: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Parallel samples (`n > 1`): sequences forked from this one once its prompt is
    /// computed, sharing its prompt's KV pages (copy-on-write).
    forks: Vec<Sequence>,
    /// Prefix-cache partition (0: shared); see [`crate::kv::salt_of`].
    cache_salt: u64,
    /// Its request's trace, when the caller traces it (phase spans; see [`crate::trace`]).
    trace: Option<SeqTrace>,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, params: SamplingParams, eos: Vec<u32>) -> Self {
        // Unseeded requests draw their seed from the thread's CSPRNG (OS-seeded): output is not
        // predictable from the request id.
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            id,
            prompt,
            output: Vec::new(),
            params,
            eos,
            rng: StdRng::seed_from_u64(seed),
            num_computed: 0,
            cached_tokens: 0,
            forks: Vec::new(),
            cache_salt: 0,
            trace: None,
        }
    }

    /// Trace this sequence (and its forks) under its request's span `request`.
    pub fn with_trace(mut self, request: Option<tracing::Span>) -> Self {
        self.trace = request.map(SeqTrace::queued);
        self
    }

    /// The span of the request this sequence belongs to, when it is traced.
    pub fn trace_span(&self) -> Option<&tracing::Span> {
        self.trace.as_ref().map(SeqTrace::request)
    }

    /// Ids of this sequence and the forks it will start.
    pub fn ids(&self) -> Vec<SeqId> {
        std::iter::once(self.id)
            .chain(self.forks.iter().map(|f| f.id))
            .collect()
    }

    /// Sample `forks` as more answers to the same prompt; they start once the prompt is
    /// computed, on its pages.
    pub fn with_forks(mut self, forks: Vec<Sequence>) -> Self {
        self.forks = forks;
        self
    }

    /// Share cached prompt pages only with sequences of the same salt.
    pub fn with_cache_salt(mut self, salt: u64) -> Self {
        self.cache_salt = salt;
        self
    }

    /// Sample the next token from `logits`; returns its event (none for end-of-sequence)
    /// and why the sequence ends, if it does.
    fn sample_next(&mut self, logits: &[f32]) -> (Option<SeqEvent>, Option<FinishReason>) {
        let tok = if self.params.adjusts_logits() {
            let mut adjusted = logits.to_vec();
            adjust_logits(&mut adjusted, &self.params, &self.prompt, &self.output);
            sample(&adjusted, &self.params, &mut self.rng)
        } else {
            sample(logits, &self.params, &mut self.rng)
        };
        let is_eos = self.params.stop_at_eos && self.eos.contains(&tok);
        let mut event = None;
        if !is_eos {
            self.output.push(tok);
            event = Some(SeqEvent::Token {
                seq: self.id,
                token: tok,
                logprobs: self.params.logprobs.map(|top| logprobs(logits, tok, top)),
            });
        }
        let reason = if is_eos {
            Some(FinishReason::Stop)
        } else if self.output.len() >= self.params.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        (event, reason)
    }

    fn finished(&self, reason: FinishReason) -> SeqEvent {
        if let Some(t) = &self.trace {
            t.finished(self.output.len(), reason.as_str());
        }
        SeqEvent::Finished {
            seq: self.id,
            reason,
            prompt_tokens: self.prompt.len(),
            completion_tokens: self.output.len(),
            cached_tokens: self.cached_tokens,
        }
    }

    fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }

    fn tokens(&self) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.output);
        t
    }
}

/// What happened to a sequence in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    Token {
        seq: SeqId,
        token: u32,
        /// When the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        seq: SeqId,
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("{waiting} requests are already waiting (max_waiting)")]
    QueueFull { waiting: usize },
    #[error("the request needs {need} KV pages but the whole cache has {total}")]
    NeverFits { need: usize, total: usize },
    #[error("the engine is shutting down")]
    ShuttingDown,
}

pub struct Scheduler {
    pub blocks: BlockManager,
    limits: SchedulerLimits,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// Chunks of the step in flight: (seq, tokens in the chunk).
    in_flight: Vec<(SeqId, usize)>,
}

impl Scheduler {
    pub fn new(blocks: BlockManager, limits: SchedulerLimits) -> Self {
        Self {
            blocks,
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: Vec::new(),
        }
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn submit(&mut self, seq: Sequence) -> Result<(), SubmitError> {
        let total = seq.prompt.len() + seq.params.max_tokens;
        // Forks share the prompt's full pages; each needs the rest.
        let need = self.blocks.pages_for(total)
            + seq.forks.len()
                * (self.blocks.pages_for(total) - seq.prompt.len() / self.blocks.page_size() + 2);
        if 1 + seq.forks.len() > self.limits.max_num_seqs {
            return Err(SubmitError::NeverFits {
                need,
                total: self.blocks.num_pages(),
            });
        }
        if need > self.blocks.num_pages() {
            return Err(SubmitError::NeverFits {
                need,
                total: self.blocks.num_pages(),
            });
        }
        if self.waiting.len() >= self.limits.max_waiting {
            return Err(SubmitError::QueueFull {
                waiting: self.waiting.len(),
            });
        }
        self.waiting.push_back(seq);
        Ok(())
    }

    /// Remove a sequence wherever it is and free its pages at once. Returns its finish
    /// event if it existed, and those of the forks it had not started yet.
    pub fn abort(&mut self, id: SeqId, reason: FinishReason) -> Vec<SeqEvent> {
        let seq = if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else {
            // A fork not started yet: it leaves its parent's list.
            for parent in self.waiting.iter_mut().chain(self.running.iter_mut()) {
                if let Some(i) = parent.forks.iter().position(|f| f.id == id) {
                    return vec![parent.forks.remove(i).finished(reason)];
                }
            }
            None
        };
        let Some(mut seq) = seq else {
            return Vec::new();
        };
        self.blocks.free(id);
        let mut events = vec![seq.finished(reason)];
        events.extend(
            std::mem::take(&mut seq.forks)
                .iter()
                .map(|f| f.finished(reason)),
        );
        events
    }

    /// Plan the next step, or `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<StepInput> {
        debug_assert!(
            self.in_flight.is_empty(),
            "schedule called with a step in flight"
        );
        let mut budget = self.limits.max_num_batched_tokens;
        let mut step = StepInput::default();
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, tokens)
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let n = (s.len() - s.num_computed).min(budget);
            if n > 0 {
                plan.push((i, n));
                budget -= n;
            }
        }
        while budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(head) = self.waiting.front() else {
                break;
            };
            if self.running.len() + 1 + head.forks.len() > self.limits.max_num_seqs
                || !self.blocks.can_admit_forks(
                    &head.prompt,
                    head.params.max_tokens,
                    head.forks.len(),
                    head.cache_salt,
                )
            {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            match self.blocks.admit_forks(
                s.id,
                &s.prompt,
                s.params.max_tokens,
                s.forks.len(),
                s.cache_salt,
            ) {
                Ok(cached) => {
                    s.num_computed = cached;
                    s.cached_tokens = cached;
                    if let Some(t) = &mut s.trace {
                        t.prefilling(s.prompt.len(), cached);
                    }
                }
                Err(_) => {
                    self.waiting.push_front(s);
                    break;
                }
            }
            let n = (s.len() - s.num_computed).min(budget);
            budget -= n;
            self.running.push(s);
            plan.push((self.running.len() - 1, n));
        }
        for (i, n) in plan {
            let s = &self.running[i];
            let out = match self.blocks.append(s.id, n) {
                Ok(o) => o,
                Err(e) => {
                    // Unreachable by construction (reservations); fail loudly in debug.
                    debug_assert!(false, "append failed: {e}");
                    continue;
                }
            };
            step.copies.extend(out.copies);
            let start = s.num_computed;
            step.chunks.push(SeqChunk {
                seq: s.id,
                tokens: (start..start + n).map(|t| s.token(t)).collect(),
                start_pos: start,
                slots: out.slots,
                block_table: self
                    .blocks
                    .block_table(s.id)
                    .map(<[_]>::to_vec)
                    .unwrap_or_default(),
                want_logits: start + n == s.len(),
            });
            self.in_flight.push((s.id, n));
        }
        if step.chunks.is_empty() {
            None
        } else {
            Some(step)
        }
    }

    /// Apply a finished step: advance computed counts, sample, finish sequences.
    pub fn complete(&mut self, out: &StepOutput) -> Vec<SeqEvent> {
        let mut events = Vec::new();
        let in_flight = std::mem::take(&mut self.in_flight);
        let batch_seqs = in_flight.len();
        for (id, n) in in_flight {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
                if let Some(t) = &s.trace {
                    t.step(batch_seqs, out.num_tokens, n);
                }
                s.num_computed += n;
                let tokens = s.tokens();
                self.blocks.commit(id, &tokens[..s.num_computed]);
            }
        }
        let mut ended: Vec<(SeqId, FinishReason)> = Vec::new();
        for (id, logits) in &out.logits {
            let Some(i) = self.running.iter().position(|s| s.id == *id) else {
                continue;
            };
            // The prompt is computed: start the forks on its pages, each sampling its own
            // first token from the same logits.
            let forks = std::mem::take(&mut self.running[i].forks);
            let (computed, cached) = (self.running[i].num_computed, self.running[i].cached_tokens);
            let parent = &mut self.running[i];
            if parent.output.is_empty() {
                if let Some(t) = &mut parent.trace {
                    t.decoding(*id);
                }
            }
            let parent_trace = parent.trace.as_ref();
            let fork_traces: Vec<Option<SeqTrace>> = forks
                .iter()
                .map(|f| parent_trace.map(|t| t.fork(f.id)))
                .collect();
            for (mut f, trace) in forks.into_iter().zip(fork_traces) {
                f.trace = trace;
                if let Err(e) = self.blocks.fork(*id, f.id, f.params.max_tokens) {
                    // Unreachable by construction (room held at admission).
                    debug_assert!(false, "fork failed: {e}");
                    events.push(f.finished(FinishReason::Error));
                    continue;
                }
                f.num_computed = computed;
                f.cached_tokens = cached;
                let (ev, reason) = f.sample_next(logits);
                events.extend(ev);
                if let Some(r) = reason {
                    ended.push((f.id, r));
                }
                self.running.push(f);
            }
        }
        // Every sequence that got logits samples its next token; they are independent (own
        // parameters, own generator), so a batch samples on the kernels' pool.
        let logits: HashMap<SeqId, &[f32]> = out
            .logits
            .iter()
            .map(|(id, l)| (*id, l.as_slice()))
            .collect();
        type Sampled = (Option<SeqEvent>, Option<FinishReason>);
        let mut jobs: Vec<(&mut Sequence, &[f32], Option<Sampled>)> = self
            .running
            .iter_mut()
            .filter_map(|s| logits.get(&s.id).map(|&l| (s, l, None)))
            .collect();
        let sample = |(seq, logits, done): &mut (&mut Sequence, &[f32], Option<Sampled>)| {
            *done = Some(seq.sample_next(logits));
        };
        match jobs.len() {
            0..=3 => jobs.iter_mut().for_each(sample),
            _ => quantmesh_kernels::Pool::global().for_each_mut(&mut jobs, sample),
        }
        for (seq, _, done) in jobs {
            if let Some((ev, reason)) = done {
                events.extend(ev);
                if let Some(r) = reason {
                    ended.push((seq.id, r));
                }
            }
        }
        for (id, r) in ended {
            events.extend(self.abort(id, r));
        }
        events
    }

    /// Fail every sequence in the step in flight (the executor returned an error).
    pub fn fail_in_flight(&mut self) -> Vec<SeqEvent> {
        let ids: Vec<SeqId> = std::mem::take(&mut self.in_flight)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        ids.into_iter()
            .flat_map(|id| self.abort(id, FinishReason::Error))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> SchedulerLimits {
        SchedulerLimits {
            max_num_seqs: 4,
            max_num_batched_tokens: 32,
            max_waiting: 8,
        }
    }

    fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    fn fake_output(step: &StepInput, tok: usize) -> StepOutput {
        StepOutput {
            logits: step
                .chunks
                .iter()
                .filter(|c| c.want_logits)
                .map(|c| {
                    let mut l = vec![0.0; 8];
                    l[tok] = 1.0;
                    (c.seq, l)
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn chunked_prefill_and_decode_share_a_step() {
        let mut s = Scheduler::new(BlockManager::new(64, 4, false), limits());
        s.submit(Sequence::new(1, (0..10).collect(), greedy(3), vec![]))
            .unwrap();
        s.submit(Sequence::new(2, (0..50).collect(), greedy(3), vec![]))
            .unwrap();
        let step = s.schedule().unwrap();
        // seq 1 whole prompt (10), seq 2 gets the remaining 22 of the budget
        assert_eq!(
            step.chunks
                .iter()
                .map(|c| c.tokens.len())
                .collect::<Vec<_>>(),
            vec![10, 22]
        );
        assert!(step.chunks[0].want_logits && !step.chunks[1].want_logits);
        let ev = s.complete(&fake_output(&step, 3));
        assert_eq!(
            ev,
            vec![SeqEvent::Token {
                seq: 1,
                token: 3,
                logprobs: None
            }]
        );
        let step = s.schedule().unwrap();
        assert_eq!(
            step.chunks
                .iter()
                .map(|c| (c.tokens.len(), c.start_pos))
                .collect::<Vec<_>>(),
            vec![(1, 10), (28, 22)]
        );
    }

    #[test]
    fn admission_waits_for_pages_and_pages_return() {
        // 8 pages of 4 tokens: a request of 10 + 6 needs 4 pages.
        let mut s = Scheduler::new(BlockManager::new(8, 4, false), limits());
        for id in 0..3 {
            s.submit(Sequence::new(id, vec![1; 10], greedy(6), vec![]))
                .unwrap();
        }
        let step = s.schedule().unwrap();
        assert_eq!(
            step.chunks.len(),
            2,
            "third must wait: no pages reserved for it"
        );
        assert_eq!(s.num_waiting(), 1);
        s.complete(&fake_output(&step, 2));
        let mut finished = 0;
        while !s.is_idle() {
            let step = s.schedule().unwrap();
            for e in s.complete(&fake_output(&step, 2)) {
                if matches!(
                    e,
                    SeqEvent::Finished {
                        reason: FinishReason::Length,
                        ..
                    }
                ) {
                    finished += 1;
                }
            }
            s.blocks.check_invariants().unwrap();
        }
        assert_eq!(finished, 3);
        assert_eq!(s.blocks.used_pages(), 0);
        assert!(matches!(
            s.submit(Sequence::new(9, vec![1; 40], greedy(1), vec![])),
            Err(SubmitError::NeverFits { .. })
        ));
    }

    #[test]
    fn eos_and_abort_free_pages() {
        let mut s = Scheduler::new(BlockManager::new(16, 4, false), limits());
        s.submit(Sequence::new(1, vec![1; 5], greedy(10), vec![7]))
            .unwrap();
        s.submit(Sequence::new(2, vec![1; 5], greedy(10), vec![]))
            .unwrap();
        let step = s.schedule().unwrap();
        let ev = s.complete(&fake_output(&step, 7));
        assert!(ev.contains(&SeqEvent::Finished {
            seq: 1,
            reason: FinishReason::Stop,
            prompt_tokens: 5,
            completion_tokens: 0,
            cached_tokens: 0
        }));
        assert!(!s.abort(2, FinishReason::Cancelled).is_empty());
        assert_eq!(s.blocks.used_pages(), 0);
        assert!(s.is_idle());
    }

    #[test]
    fn queue_is_bounded() {
        let mut s = Scheduler::new(
            BlockManager::new(16, 4, false),
            SchedulerLimits {
                max_waiting: 2,
                ..limits()
            },
        );
        s.submit(Sequence::new(1, vec![1], greedy(1), vec![]))
            .unwrap();
        s.submit(Sequence::new(2, vec![1], greedy(1), vec![]))
            .unwrap();
        assert_eq!(
            s.submit(Sequence::new(3, vec![1], greedy(1), vec![])),
            Err(SubmitError::QueueFull { waiting: 2 })
        );
    }
}
