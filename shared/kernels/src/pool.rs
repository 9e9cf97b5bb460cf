//! One persistent pool of workers for the forward pass.
//!
//! The caller is worker 0 and runs its share itself; the other workers spin briefly after
//! each job (the next matmul of a step comes within microseconds), then yield, then sleep
//! until the next job, so an idle server costs nothing. Work is split by the caller into
//! static contiguous ranges, one per thread: no queue, no stealing, one wait per call.
//!
//! One caller at a time: a call made while the pool is busy (another thread's, or a call
//! from inside a job) runs every share itself, serially, and gets the same result.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::Duration;

/// A job as the workers see it: `f(index, threads)`.
type Job = dyn Fn(usize, usize) + Sync;

/// A job reference whose lifetime [`Pool::run`] guarantees by waiting for every worker
/// before it returns (or unwinds).
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync`, and `Pool::run` keeps it alive until every worker is done.
unsafe impl Send for JobPtr {}

struct Shared {
    epoch: AtomicU64,
    job: Mutex<Option<JobPtr>>,
    threads: usize,
    pending: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
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
    /// A pool of `threads` (≥ 1; the caller counts as one, so `threads - 1` are started).
    /// Where a worker cannot be started the pool runs everything on the caller.
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared::new(threads));
        let mut handles = Vec::with_capacity(threads - 1);
        for index in 1..threads {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name(format!("quantmesh-kernel-{index}"))
                .spawn(move || worker(&s, index))
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

    /// Run `f(index, threads)` for every `index < threads`, each on its own thread (the
    /// caller runs index 0), and return when all are done. A panic in any share is raised
    /// here after every share has finished.
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
        // SAFETY: the lifetime is erased only for the workers; `Wait` below blocks until
        // every worker has finished with the job, on return and on unwind alike.
        let erased: *const Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), *const Job>(f)
        };
        *lock(&s.job) = Some(JobPtr(erased));
        s.pending.store(n - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&s.sleep);
            s.wake.notify_all();
        }
        let wait = Wait(s);
        f(0, n);
        drop(wait);
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a kernel worker panicked");
        }
    }

    /// `f` on every item of `items`, each thread taking a contiguous share (see
    /// [`Pool::run`]: a concurrent or nested call runs on the calling thread alone).
    pub fn for_each_mut<T: Send>(&self, items: &mut [T], f: impl Fn(&mut T) + Sync) {
        // Each thread touches only the items of its own share (disjoint ranges), and `run`
        // returns after every share is done, while `items` is still borrowed.
        let (base, n) = (Disjoint(items.as_mut_ptr()), items.len());
        self.run(&|i, t| {
            for k in share(n, i, t) {
                // SAFETY: `k < n`, and no other thread's share contains `k`.
                f(unsafe { &mut *base.at(k) })
            }
        });
    }
}

/// Waits for the workers' shares, then withdraws the job.
struct Wait<'a>(&'a Shared);

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.0.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *lock(&self.0.job) = None;
    }
}

impl Shared {
    fn new(threads: usize) -> Shared {
        Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            threads,
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        }
    }
}

fn worker(s: &Shared, index: usize) {
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
        if let Some(JobPtr(p)) = job {
            // SAFETY: `Pool::run` published this job and waits for `pending` to reach zero
            // before the closure it points to can go away.
            let f: &Job = unsafe { &*p };
            if catch_unwind(AssertUnwindSafe(|| f(index, s.threads))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
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

/// The contiguous share `index` of `threads` gets of `0..n`.
pub fn share(n: usize, index: usize, threads: usize) -> std::ops::Range<usize> {
    let per = n / threads;
    let extra = n % threads;
    let start = index * per + index.min(extra);
    let len = per + usize::from(index < extra);
    start..start + len
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
    fn shares_cover_the_range_once() {
        for n in [0, 1, 7, 64, 100] {
            for t in 1..6 {
                let mut next = 0;
                for i in 0..t {
                    let r = share(n, i, t);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
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
}
