//! Accepting connections: axum's router on hyper, with a header-read timeout that axum's own
//! `serve` does not set. A client that opens a connection and sends its request head slowly,
//! or not at all (also an idle keep-alive connection waiting for its next request), is
//! disconnected after [`HEADER_READ_TIMEOUT`] instead of holding a socket and a task forever.
//! Shutdown is graceful: no new connections, open ones finish their response.

use std::future::Future;
use std::time::Duration;

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
        let service = TowerToHyperService::new(app.clone().map_request(|r: Request<Incoming>| r.map(Body::new)));
        let (mut stop, open) = (stop_rx.clone(), open_rx.clone());
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let mut stopping = false;
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
                }
            }
            drop(open);
        });
    }
    drop(stop_tx);
    drop(open_rx);
    open_tx.closed().await;
}
