//! Scheduling helpers shared by the session layer and the edges above it.

use std::task::Poll;

/// Lets the tasks already woken on this thread run first, as
/// `tokio::task::yield_now` does, without polling the I/O driver on the
/// way. A yielding task is deferred, and a current-thread runtime
/// (`tiller acp --embedded`) polls the driver (an `epoll_wait` system call)
/// before it runs deferred tasks; a task that wakes itself is queued behind
/// the ones woken before it (tokio reschedules a task woken while it runs
/// at the back of its queue). On a multi-thread runtime that reschedule
/// would also wake an idle worker, which takes half the queue and may run
/// the very tasks waited for beside this one: there it is `yield_now`. For
/// one-off yields on a hot path only: a loop of them would starve I/O
/// until the runtime's next regular driver poll.
pub async fn yield_to_woken() {
    let current_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    if !current_thread {
        return tokio::task::yield_now().await;
    }
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if std::mem::replace(&mut yielded, true) {
            return Poll::Ready(());
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The tasks woken before the yield run before it returns, once each,
    /// on both runtimes (by its own reschedule on a current-thread one,
    /// `yield_now` on a multi-thread one); the yielding task goes on after
    /// them.
    #[test]
    fn the_tasks_woken_before_it_run_first() {
        let current = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        for rt in [current, multi] {
            let order = rt.block_on(async {
                tokio::spawn(async {
                    let ran = Arc::new(AtomicUsize::new(0));
                    for _ in 0..3 {
                        let ran = ran.clone();
                        tokio::spawn(async move { ran.fetch_add(1, Ordering::SeqCst) });
                    }
                    let before = ran.load(Ordering::SeqCst);
                    super::yield_to_woken().await;
                    (before, ran.load(Ordering::SeqCst))
                })
                .await
                .unwrap()
            });
            assert_eq!(order, (0, 3));
        }
    }
}
