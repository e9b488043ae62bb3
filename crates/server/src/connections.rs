//! Accepting connections: axum's router on hyper, with the timeouts axum's own `serve` does
//! not set, so no client holds a socket and a task forever (a macOS GUI app may have only 256
//! descriptors):
//! - a request head must arrive within [`HEADER_READ_TIMEOUT`] (HTTP/1; also an idle
//!   keep-alive connection waiting for its next request);
//! - a connection with no request in flight for that long is closed, HTTP/2 too (an idle
//!   h2c connection otherwise stays open as long as it answers pings);
//! - a request body that sends nothing for that long fails the request (tower-http's
//!   `TimeoutBody`).
//!
//! Shutdown is graceful: no new connections, open ones finish their response.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;
use tower_http::timeout::TimeoutBody;

/// How long a client has to send a request's head (and an idle connection to start one).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` completes; then stops accepting and returns once
/// every open connection has finished.
pub async fn serve(listener: TcpListener, app: Router, shutdown: impl Future<Output = ()> + Send + 'static) {
    serve_with(listener, app, shutdown, HEADER_READ_TIMEOUT).await
}

/// [`serve`] with another header-read timeout (tests).
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_read_timeout: Duration,
) {
    // Dropped at shutdown: every connection's task sees it and finishes gracefully.
    let (stop_tx, stop_rx) = watch::channel(());
    // Held by every connection's task: closed once the last one ends.
    let (open_tx, open_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait, then accept again.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let activity = Activity::new();
        let counted = activity.clone();
        let router = app.clone();
        let service = TowerToHyperService::new(tower::service_fn(move |r: Request<Incoming>| {
            let in_flight = counted.begin();
            let r = r.map(|body| Body::new(TimeoutBody::new(header_read_timeout, body)));
            let call = router.clone().oneshot(r);
            async move {
                let response = call.await?;
                Ok::<_, std::convert::Infallible>(
                    response.map(|body| Body::new(Guarded { body, _in_flight: in_flight })),
                )
            }
        }));
        let (mut stop, open) = (stop_rx.clone(), open_rx.clone());
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
            builder.http2().timer(TokioTimer::new());
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let mut stopping = false;
            let mut idle_check = tokio::time::interval(header_read_timeout / 4);
            // An idle connection told to go (HTTP/2's GOAWAY and the ping behind it) that is
            // still open this much later is dropped: a peer that never answers keeps it.
            let mut closing_since: Option<Instant> = None;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!("connection ended: {e}");
                        }
                        break;
                    }
                    _ = stop.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ = idle_check.tick() => {
                        let idle = activity.idle_for();
                        if closing_since.is_some_and(|t| t.elapsed() > header_read_timeout) && idle.is_some() {
                            break;
                        }
                        if !stopping && idle.is_some_and(|idle| idle > header_read_timeout) {
                            stopping = true;
                            closing_since = Some(Instant::now());
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            drop(open);
        });
    }
    drop(stop_tx);
    drop(open_rx);
    open_tx.closed().await;
}

/// A connection's requests in flight and when the last one ended.
#[derive(Clone)]
struct Activity(Arc<Requests>);

struct Requests {
    in_flight: AtomicUsize,
    last_ended: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Activity(Arc::new(Requests { in_flight: AtomicUsize::new(0), last_ended: Mutex::new(Instant::now()) }))
    }

    /// A request began; the guard it returns ends it when dropped (with the response's body,
    /// once the response has been sent whole: a stream is a request in flight).
    fn begin(&self) -> InFlight {
        self.0.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// How long the connection has had no request in flight (`None` while one is).
    fn idle_for(&self) -> Option<Duration> {
        if self.0.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        self.0.last_ended.lock().ok().map(|t| t.elapsed())
    }
}

struct InFlight(Activity);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut t) = self.0 .0.last_ended.lock() {
            *t = Instant::now();
        }
        self.0 .0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that holds its request's in-flight guard until it is dropped.
struct Guarded {
    body: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Guarded {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
