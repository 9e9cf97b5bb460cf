//! One persistent pool of workers for the forward pass.
//!
//! A call's work comes as `threads` indices, `f(index, threads)`. The caller and the workers
//! claim indices from one counter until none is left, so the caller runs its own and then
//! any index no worker has claimed yet: a worker that is descheduled (another process on its
//! core, a thread of this one) when a job is published costs that job nothing, instead of
//! holding the caller at the barrier until the operating system runs it again. Workers spin
//! briefly after each job (the next matmul of a step comes within microseconds), then yield,
//! then sleep until the next job, so an idle server costs nothing.
//!
//! One caller at a time: a call made while the pool is busy (another thread's, or a call
//! from inside a job) runs every share itself, serially, and gets the same result.

use std::cell::Cell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::Duration;

/// Values from which a per-row operation (a batch's activation quantization, RMSNorm)
/// splits its rows over the pool's threads ([`Pool::rows_per_share`]): below it, waking the
/// workers costs more than the rows.
const ROW_SPLIT_VALUES: usize = 8 * 1024;

/// A job as the workers see it: `f(index, threads)`.
type Job = dyn Fn(usize, usize) + Sync;

/// A job reference whose lifetime [`Pool::run`] guarantees: a worker dereferences it only
/// after claiming one of the job's indices, and the call waits for every claimed index.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync`, and `Pool::run` keeps it alive until every claimed index
// is done.
unsafe impl Send for JobPtr {}

/// The low bits of [`Shared::claims`] hold the next unclaimed index, the high bits the job's
/// tag (its epoch, truncated), so a claim on a finished job's tag can never succeed.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// The most threads a pool runs (the index field's range, with room to count past it).
const MAX_THREADS: usize = 1 << 20;

struct Shared {
    /// Bumped once per job: what wakes the workers.
    epoch: AtomicU64,
    /// The current job and its tag, `None` between jobs.
    job: Mutex<Option<(JobPtr, u64)>>,
    threads: usize,
    /// The current job's tag and next unclaimed index.
    claims: AtomicU64,
    /// The current job's indices finished (run, or given up after a panic).
    done: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
    /// Test hook: while set, a worker that has taken a job waits before claiming, as a
    /// descheduled one would.
    #[cfg(test)]
    hold: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Busy-wait rounds before yielding, and yields before sleeping.
const SPINS: u32 = 20_000;
const YIELDS: u32 = 200;

/// What [`Pool::fill_rows`] calls per row: the row's index and its slices of both buffers.
pub type RowFill<'a> = dyn Fn(usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// A buffer's start, shared by the pool's threads of one call ([`Pool::for_each_mut`],
/// [`Pool::fill_rows`]), each of which writes only its own disjoint elements.
struct Disjoint<T>(*mut T);
// SAFETY: only made by `for_each_mut` and `fill_rows`, whose threads touch disjoint elements
// of a buffer that stays borrowed until `run` has returned after every share is done.
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    /// The address `offset` elements in (a method, so closures capture the `Sync` wrapper
    /// rather than its raw pointer field).
    fn at(&self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }
}

pub struct Pool {
    shared: Arc<Shared>,
    run_lock: Mutex<()>,
    handles: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of `threads` (≥ 1; the caller counts as one, so `threads - 1` are started;
    /// at most 2²⁰). Where a worker cannot be started the pool runs everything on the caller.
    pub fn new(threads: usize) -> Pool {
        let threads = threads.clamp(1, MAX_THREADS);
        let shared = Arc::new(Shared::new(threads));
        let mut handles = Vec::with_capacity(threads - 1);
        for index in 1..threads {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name(format!("quantmesh-kernel-{index}"))
                .spawn(move || worker(&s))
            {
                Ok(h) => handles.push(h),
                Err(_) => {
                    let mut failed = Pool {
                        shared,
                        run_lock: Mutex::new(()),
                        handles,
                    };
                    failed.stop();
                    return Pool {
                        shared: Arc::new(Shared::new(1)),
                        run_lock: Mutex::new(()),
                        handles: Vec::new(),
                    };
                }
            }
        }
        Pool {
            shared,
            run_lock: Mutex::new(()),
            handles,
        }
    }

    /// The process's pool: `QUANTMESH_THREADS` threads, else one per available core.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool::new(default_threads()))
    }

    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Whether a call made now would run on the calling thread alone: the pool has one
    /// thread, or another job holds it (a call nested in a pool job, or a concurrent one).
    /// A hint for splitting work (the answer may change as soon as it is given).
    pub fn busy(&self) -> bool {
        self.shared.threads == 1
            || matches!(self.run_lock.try_lock(), Err(TryLockError::WouldBlock))
    }

    /// Run `one` over `0..units` in contiguous chunks (a quarter of an even share each),
    /// which the threads take in order from one counter: a thread that starts late or runs
    /// slower (a busy core, a cold cache) does not hold the others at the barrier. With
    /// `serial`, the caller runs them all.
    pub(crate) fn chunks(&self, units: usize, serial: bool, one: &(dyn Fn(Range<usize>) + Sync)) {
        let next = AtomicUsize::new(0);
        let work = |_: usize, n: usize| {
            let chunk = units.div_ceil(4 * n).max(1);
            loop {
                let start = next.fetch_add(1, Ordering::Relaxed) * chunk;
                if start >= units {
                    return;
                }
                one(start..(start + chunk).min(units));
            }
        };
        if serial {
            work(0, 1);
        } else {
            self.run(&work);
        }
    }

    /// Rows per share when a per-row operation over `rows` rows (`values` values in all) is
    /// split over the threads with [`Pool::for_each_mut`]: an even share of whole rows per
    /// thread, or every row in one share below [`ROW_SPLIT_VALUES`] values (at least 1).
    pub(crate) fn rows_per_share(&self, rows: usize, values: usize) -> usize {
        if values >= ROW_SPLIT_VALUES && rows > 1 {
            rows.div_ceil(self.threads())
        } else {
            rows.max(1)
        }
    }

    /// Fill two buffers of rows of `width` values (equal lengths) on the pool's threads:
    /// `f(row, a_row, b_row)` for every row, each row on one thread; serially on the caller
    /// below `serial_below` values per buffer, where handing the rows out would cost more
    /// than it saves. (A sequence's keys and values are read this way before attention.)
    pub fn fill_rows(
        &self,
        a: &mut [f32],
        b: &mut [f32],
        width: usize,
        serial_below: usize,
        f: &RowFill<'_>,
    ) {
        if width == 0 {
            return;
        }
        let rows = a.len().min(b.len()) / width;
        if rows * width < serial_below {
            for (r, (ra, rb)) in a
                .chunks_exact_mut(width)
                .zip(b.chunks_exact_mut(width))
                .enumerate()
            {
                f(r, ra, rb);
            }
            return;
        }
        let (pa, pb) = (Disjoint(a.as_mut_ptr()), Disjoint(b.as_mut_ptr()));
        self.chunks(rows, false, &|range| {
            for r in range {
                // SAFETY: `r < rows`, so both rows lie inside their buffers (each holds at
                // least `rows * width` values), and every row index is handed to exactly one
                // thread by `chunks`, so no two threads touch the same row; the buffers
                // outlive the call (`run` returns after every share has finished).
                let (ra, rb) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(pa.at(r * width), width),
                        std::slice::from_raw_parts_mut(pb.at(r * width), width),
                    )
                };
                f(r, ra, rb);
            }
        });
    }

    /// Run `f(index, threads)` once for every `index < threads` and return when all are
    /// done. The caller and the workers claim indices from one counter (the caller starts
    /// at once, so it usually gets index 0), and the caller keeps claiming until none is
    /// left: the call never waits for a worker that has not started, only for indices that
    /// are running. So an index may run on any of the pool's threads. A panic in any index
    /// is raised here after every claimed index has finished (the caller's own, if it had
    /// one, else "a kernel worker panicked").
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.shared.threads;
        if n == 1 {
            f(0, 1);
            return;
        }
        let _guard = match self.run_lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                for i in 0..n {
                    f(i, n);
                }
                return;
            }
        };
        let s = &*self.shared;
        // SAFETY: the lifetime is erased only for the workers, which dereference the pointer
        // only after a claim on this job's tag succeeds; `Wait` below blocks until every
        // claimed index is done, and closes the claims, before this call returns or unwinds.
        let erased: *const Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), *const Job>(f)
        };
        // Only the holder of `run_lock` writes `epoch`, so this is the job's epoch.
        let tag = (s.epoch.load(Ordering::Relaxed) + 1) & (u64::MAX >> INDEX_BITS);
        s.done.store(0, Ordering::SeqCst);
        s.claims.store(tag << INDEX_BITS, Ordering::SeqCst);
        *lock(&s.job) = Some((JobPtr(erased), tag));
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&s.sleep);
            s.wake.notify_all();
        }
        let wait = Wait {
            s,
            tag,
            running: Cell::new(false),
        };
        while let Some(i) = s.claim(tag) {
            wait.running.set(true);
            f(i, n);
            wait.running.set(false);
            s.done.fetch_add(1, Ordering::Release);
        }
        drop(wait);
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a kernel worker panicked");
        }
    }

    /// `f` on every item of `items`, the threads taking contiguous chunks in order (see
    /// [`Pool::chunks`]; a concurrent or nested call, or a single item, runs on the calling
    /// thread alone).
    pub fn for_each_mut<T: Send>(&self, items: &mut [T], f: impl Fn(&mut T) + Sync) {
        // Each chunk is handed to one thread (disjoint ranges), and `chunks` returns after
        // every chunk is done, while `items` is still borrowed.
        let (base, n) = (Disjoint(items.as_mut_ptr()), items.len());
        self.chunks(n, n <= 1, &|range| {
            for k in range {
                // SAFETY: `k < n`, and no other chunk contains `k`.
                f(unsafe { &mut *base.at(k) })
            }
        });
    }
}

/// Closes a job's claims, waits for every claimed index, then withdraws the job: on the
/// caller's return, and as a panic in one of the caller's indices unwinds.
struct Wait<'a> {
    s: &'a Shared,
    tag: u64,
    /// The caller is inside one of its indices (so, dropped while set, that index panicked).
    running: Cell<bool>,
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        let s = self.s;
        if self.running.get() {
            // The caller's index panicked: it is over, and the indices nobody has claimed
            // are given up; the panic goes on to the caller once the workers' are done.
            s.done.fetch_add(1, Ordering::Release);
            while let Some(_skipped) = s.claim(self.tag) {
                s.done.fetch_add(1, Ordering::Release);
            }
        }
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < s.threads {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *lock(&s.job) = None;
        if self.running.get() {
            s.panicked.store(false, Ordering::SeqCst);
        }
    }
}

impl Shared {
    fn new(threads: usize) -> Shared {
        Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            threads,
            claims: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            #[cfg(test)]
            hold: AtomicBool::new(false),
        }
    }

    /// The next index of the job tagged `tag`, unless that job is over or has handed out
    /// every index.
    fn claim(&self, tag: u64) -> Option<usize> {
        let mut cur = self.claims.load(Ordering::Acquire);
        loop {
            let index = (cur & INDEX_MASK) as usize;
            if cur >> INDEX_BITS != tag || index >= self.threads {
                return None;
            }
            match self.claims.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(index),
                Err(now) => cur = now,
            }
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else if spins < SPINS + YIELDS {
                std::thread::yield_now();
            } else {
                let g = lock(&s.sleep);
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                if s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    // The timeout is a safety net only; a new job notifies.
                    let _ = s.wake.wait_timeout(g, Duration::from_millis(50));
                } else {
                    drop(g);
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                spins = 0;
            }
        }
        let job = *lock(&s.job);
        if let Some((JobPtr(p), tag)) = job {
            #[cfg(test)]
            while s.hold.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            while let Some(i) = s.claim(tag) {
                // SAFETY: the claim succeeded, so the job tagged `tag` is still running: its
                // `Pool::run` waits for index `i` to be done before the closure can go away.
                let f: &Job = unsafe { &*p };
                if catch_unwind(AssertUnwindSafe(|| f(i, s.threads))).is_err() {
                    s.panicked.store(true, Ordering::SeqCst);
                }
                s.done.fetch_add(1, Ordering::Release);
            }
        }
    }
}

impl Pool {
    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = lock(&self.shared.sleep);
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `QUANTMESH_THREADS` when it is a positive number, else the available cores.
pub fn default_threads() -> usize {
    std::env::var("QUANTMESH_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_index_runs_once_per_call() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads);
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|i, n| {
                    assert_eq!(n, threads);
                    hits[i].fetch_add(1, Ordering::SeqCst);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
            }
        }
    }

    /// A per-row operation splits whole rows evenly over the threads from the threshold on,
    /// and keeps them in one share below it (or with one row); one share runs on the caller
    /// without waking the workers.
    #[test]
    fn rows_are_shared_from_the_threshold_and_one_share_runs_on_the_caller() {
        let pool = Pool::new(2);
        assert_eq!(pool.rows_per_share(37, ROW_SPLIT_VALUES), 19);
        assert_eq!(pool.rows_per_share(37, ROW_SPLIT_VALUES - 1), 37);
        assert_eq!(pool.rows_per_share(1, 10 * ROW_SPLIT_VALUES), 1);
        assert_eq!(pool.rows_per_share(0, 0), 1);
        assert_eq!(Pool::new(1).rows_per_share(37, ROW_SPLIT_VALUES), 37);
        // One share publishes no job to the workers (the job epoch stays), two do.
        let epoch = || pool.shared.epoch.load(Ordering::SeqCst);
        let before = epoch();
        let mut one = [0];
        pool.for_each_mut(&mut one, |v| *v += 1);
        assert_eq!((one, epoch()), ([1], before));
        let mut two = [0, 0];
        pool.for_each_mut(&mut two, |v| *v += 1);
        assert_eq!((two, epoch()), ([1, 1], before + 1));
    }

    /// Every row of both buffers is handed to `f` once, with its own index, on the pool and
    /// serially below the threshold; a call nested in a pool job runs on its thread.
    #[test]
    fn fill_rows_writes_every_row_once() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads);
            for (rows, width, serial_below) in [(0, 4, 0), (1, 4, 0), (97, 8, 0), (97, 8, 1 << 20)]
            {
                let (mut a, mut b) = (vec![0f32; rows * width], vec![0f32; rows * width]);
                let calls = AtomicUsize::new(0);
                pool.fill_rows(&mut a, &mut b, width, serial_below, &|r, ra, rb| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    assert_eq!((ra.len(), rb.len()), (width, width));
                    ra.iter_mut().for_each(|x| *x += r as f32);
                    rb.iter_mut().for_each(|x| *x -= r as f32);
                });
                assert_eq!(calls.load(Ordering::SeqCst), rows);
                for r in 0..rows {
                    assert!(a[r * width..(r + 1) * width].iter().all(|&x| x == r as f32));
                    assert!(b[r * width..(r + 1) * width]
                        .iter()
                        .all(|&x| x == -(r as f32)));
                }
            }
            // Nested in a job: no deadlock, the same result.
            pool.run(&|i, _| {
                if i == 0 {
                    let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
                    pool.fill_rows(&mut a, &mut b, 2, 0, &|r, ra, rb| {
                        ra.fill(r as f32);
                        rb.fill(1.0);
                    });
                    assert_eq!(a[63], 31.0);
                    assert!(b.iter().all(|&x| x == 1.0));
                }
            });
        }
    }

    #[test]
    fn a_call_does_not_wait_for_a_worker_that_has_not_started() {
        for threads in [2, 3, 5] {
            let pool = Pool::new(threads);
            pool.shared.hold.store(true, Ordering::SeqCst);
            let caller = std::thread::current().id();
            let ran: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            let stolen = AtomicUsize::new(0);
            for _ in 0..50 {
                ran.iter().for_each(|r| r.store(0, Ordering::SeqCst));
                pool.run(&|i, n| {
                    assert_eq!(n, threads);
                    ran[i].fetch_add(1, Ordering::SeqCst);
                    if std::thread::current().id() != caller {
                        stolen.fetch_add(1, Ordering::SeqCst);
                    }
                });
                assert!(ran.iter().all(|r| r.load(Ordering::SeqCst) == 1));
            }
            assert_eq!(
                stolen.load(Ordering::SeqCst),
                0,
                "a held worker ran an index"
            );
            // Released: the workers' stale jobs are over, and every new index runs once.
            pool.shared.hold.store(false, Ordering::SeqCst);
            let by_worker = AtomicUsize::new(0);
            for _ in 0..200 {
                ran.iter().for_each(|r| r.store(0, Ordering::SeqCst));
                pool.run(&|i, _| {
                    ran[i].fetch_add(1, Ordering::SeqCst);
                    if std::thread::current().id() != caller {
                        by_worker.fetch_add(1, Ordering::SeqCst);
                    } else {
                        // give the workers time to claim the other indices
                        std::thread::sleep(Duration::from_micros(200));
                    }
                });
                assert!(ran.iter().all(|r| r.load(Ordering::SeqCst) == 1));
            }
            assert!(
                by_worker.load(Ordering::SeqCst) > 0,
                "the workers took part again"
            );
        }
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_keeps_working() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i, _| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_nested_or_concurrent_call_runs_serially() {
        let pool = Pool::new(2);
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            pool.run(&|_, _| {
                hits.fetch_add(1, Ordering::SeqCst);
            });
        });
        assert_eq!(hits.load(Ordering::SeqCst), 4);
        // and once the worker has gone to sleep (past its spin and yield phases), a new job
        // still wakes it
        for _ in 0..10_000 {
            if pool.shared.sleepers.load(Ordering::SeqCst) == 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            pool.shared.sleepers.load(Ordering::SeqCst),
            1,
            "the worker went to sleep"
        );
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    /// `busy` says whether a call would run on its caller alone: inside a job (nested), on a
    /// one-thread pool; not between jobs of a pool with workers.
    #[test]
    fn busy_is_true_inside_a_job_and_on_one_thread() {
        let pool = Pool::new(2);
        assert!(!pool.busy());
        let inside = AtomicUsize::new(0);
        pool.run(&|_, _| {
            if pool.busy() {
                inside.fetch_add(1, Ordering::SeqCst);
            }
        });
        assert_eq!(inside.load(Ordering::SeqCst), 2);
        assert!(!pool.busy(), "free again after the job");
        assert!(Pool::new(1).busy());
    }
}
