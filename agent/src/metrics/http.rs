//! The `/metrics` endpoint: a small HTTP/1.1 server on the agent's runtime. Each
//! connection gets one response and is closed; a request that is not HTTP gets 400 and the
//! agent goes on; a client that sends nothing is dropped after a few seconds.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::Metrics;

/// Longest request head read (request line and headers).
const MAX_HEAD: usize = 8192;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The body's type for clients that accept OpenMetrics (Prometheus asks for it).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The body's type for the others (curl, promtool, older scrapers).
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The exposition in Prometheus's text format 0.0.4 from its OpenMetrics form: a
/// counter's family is named with its `_total` suffix, and the lines that format lacks
/// (`# UNIT`, `# EOF`) are left out.
#[must_use]
pub fn text_format(openmetrics: &str) -> String {
    use std::fmt::Write as _;
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some(name) = rest.strip_suffix(" counter")
        {
            counters.insert(name.to_owned());
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                let _ = write!(out, "{prefix}{name}{total} {tail}");
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Binds `addr` (before anything is traced, so a taken port stops the agent at once).
pub fn bind(addr: &str) -> Result<std::net::TcpListener, crate::Error> {
    let parsed: SocketAddr = addr.parse().map_err(|_| crate::Error::InvalidArgument {
        what: "--metrics address",
        value: addr.to_owned(),
        expected: "IP:PORT, for example 127.0.0.1:9464 (loopback only) or 0.0.0.0:9464 (every \
                   interface)",
    })?;
    let listener =
        std::net::TcpListener::bind(parsed).map_err(|source| crate::Error::MetricsAddress {
            addr: addr.to_owned(),
            source,
        })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| crate::Error::MetricsAddress {
            addr: addr.to_owned(),
            source,
        })?;
    Ok(listener)
}

/// Serves `metrics` on `listener` until the returned task is aborted.
pub fn serve(
    listener: std::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                // Out of descriptors or similar: try again shortly rather than spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let _ = answer(stream, metrics).await;
            });
        }
    }))
}

/// The status, content type and body for a request head.
#[must_use]
pub fn respond(head: &[u8], metrics: &Metrics) -> (u16, &'static str, String) {
    let text = |s: &str| s.to_owned();
    let Some(line) = std::str::from_utf8(head)
        .ok()
        .and_then(|h| h.split("\r\n").next())
    else {
        return (400, "text/plain", text("bad request: not text\n"));
    };
    let parts: Vec<&str> = line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return (400, "text/plain", text("bad request: no request line\n"));
    };
    if !version.starts_with("HTTP/1.") {
        return (400, "text/plain", text("bad request: not HTTP/1.x\n"));
    }
    if method != "GET" && method != "HEAD" {
        return (405, "text/plain", text("only GET is served\n"));
    }
    match target.split('?').next() {
        Some("/metrics") if accepts_openmetrics(head) => (200, OPENMETRICS, metrics.encode()),
        Some("/metrics") => (200, TEXT_FORMAT, text_format(&metrics.encode())),
        Some("/") => (
            200,
            "text/plain",
            text("nccltrace: the metrics are at /metrics\n"),
        ),
        _ => (
            404,
            "text/plain",
            text("not found: the metrics are at /metrics\n"),
        ),
    }
}

/// The request's Accept header names OpenMetrics.
fn accepts_openmetrics(head: &[u8]) -> bool {
    String::from_utf8_lossy(head).lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("accept") && v.contains("application/openmetrics-text")
        })
    })
}

async fn answer(mut stream: tokio::net::TcpStream, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    if tokio::time::timeout(READ_TIMEOUT, read).await.is_err() {
        return Ok(());
    }
    if head.is_empty() {
        return Ok(());
    }
    // Off the runtime's thread, which drains the rings: a scrape reads the node's files,
    // and an InfiniBand port's counters are queries of the adapter's firmware. (The
    // runtime is shut down without waiting for a read that never returns.)
    let is_head = head.starts_with(b"HEAD ");
    let answered = tokio::task::spawn_blocking(move || respond(&head, &metrics)).await;
    let Ok((status, content_type, body)) = answered else {
        return Ok(());
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Bad Request",
    };
    let mut response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !is_head {
        response.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&response).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> Metrics {
        Metrics::new(crate::host::Host::live())
    }

    /// `metrics` served on a loopback port by a current-thread runtime, as the agent
    /// serves them: the runtime, the address, the server's task.
    fn served(
        metrics: Metrics,
    ) -> (
        tokio::runtime::Runtime,
        SocketAddr,
        tokio::task::JoinHandle<()>,
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = {
            let _inside = runtime.enter();
            serve(listener, Arc::new(metrics)).unwrap()
        };
        (runtime, addr, server)
    }

    /// Bad requests get 400, other paths 404, other methods 405; Prometheus (which asks
    /// for OpenMetrics) gets OpenMetrics, anyone else the 0.0.4 text format.
    #[test]
    fn requests_and_content_negotiation() {
        let m = metrics();
        let status = |head: &str| respond(head.as_bytes(), &m).0;
        assert_eq!(status("garbage\r\n\r\n"), 400);
        assert_eq!(status("GET /metrics SPDY/3\r\n\r\n"), 400);
        assert_eq!(status("\u{0}\u{1}\r\n\r\n"), 400);
        assert_eq!(status("GET /nothing HTTP/1.1\r\n\r\n"), 404);
        assert_eq!(status("POST /metrics HTTP/1.1\r\n\r\n"), 405);
        assert_eq!(status("GET / HTTP/1.0\r\n\r\n"), 200);
        let (code, kind, body) = respond(
            b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
            &m,
        );
        assert_eq!((code, kind), (200, OPENMETRICS));
        assert!(body.ends_with("# EOF\n"), "{body}");
        let (code, kind, body) = respond(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n", &m);
        assert_eq!((code, kind), (200, TEXT_FORMAT));
        assert!(
            !body.contains("# EOF") && !body.contains("# UNIT"),
            "{body}"
        );
        assert!(
            body.contains("# TYPE nccltrace_agent_cpu_seconds_total counter"),
            "{body}"
        );
    }

    #[test]
    fn text_format_names_counters_with_their_suffix() {
        let om = "# HELP a_seconds A.\n# TYPE a_seconds counter\n# UNIT a_seconds seconds\n\
                  a_seconds_total{x=\"1\"} 2.0\n# TYPE b gauge\nb 1\n# EOF\n";
        assert_eq!(
            text_format(om),
            "# HELP a_seconds_total A.\n# TYPE a_seconds_total counter\n\
             a_seconds_total{x=\"1\"} 2.0\n# TYPE b gauge\nb 1\n"
        );
    }

    /// A served scrape, a malformed request that gets 400 with the server still serving,
    /// and a client that sends nothing does not hold up the others.
    #[test]
    fn serves_over_tcp() {
        use std::io::{Read as _, Write as _};
        let (runtime, addr, _server) = served(metrics());
        let thread = std::thread::spawn(move || {
            let ask = |request: &[u8]| -> String {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.write_all(request).unwrap();
                let mut answer = String::new();
                s.read_to_string(&mut answer).unwrap();
                answer
            };
            let _silent = std::net::TcpStream::connect(addr).unwrap();
            let bad = ask(b"nonsense\r\n\r\n");
            let good = ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
            (bad, good)
        });
        let (bad, good) = runtime.block_on(async {
            while !thread.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            thread.join().unwrap()
        });
        assert!(bad.starts_with("HTTP/1.1 400 "), "{bad}");
        assert!(good.starts_with("HTTP/1.1 200 OK\r\n"), "{good}");
        assert!(good.contains("nccltrace_agent_cpu_seconds_total"), "{good}");
    }

    /// A scrape that waits on a slow file of the node (a counter of an adapter's firmware;
    /// here a FIFO nobody writes to for 2 s) does not hold up the runtime that drains the
    /// rings, and is answered once the file reads.
    #[test]
    fn a_slow_scrape_does_not_hold_up_the_drain() {
        use std::io::{Read as _, Write as _};
        let dir = tempfile::tempdir().unwrap();
        let counters = dir
            .path()
            .join("sys/class/infiniband/mlx5_0/ports/1/counters");
        std::fs::create_dir_all(&counters).unwrap();
        let fifo = counters.join("port_xmit_data");
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let (runtime, addr, _server) = served(Metrics::new(crate::host::Host::at(dir.path())));
        let client = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).unwrap();
            answer
        });
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            std::fs::write(fifo, "7\n").unwrap();
        });
        // The runtime goes on while the scrape waits: 20 ticks of 10 ms, well before the
        // file reads.
        let started = std::time::Instant::now();
        runtime.block_on(async {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let ticking = started.elapsed();
        let answer = runtime.block_on(async {
            while !client.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            client.join().unwrap()
        });
        writer.join().unwrap();
        assert!(
            ticking < Duration::from_millis(1500),
            "the runtime stood still for {ticking:?} while a scrape read a slow file"
        );
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("direction=\"transmit\"} 28"), "{answer}");
    }

    /// A taken port is bad input naming the address; so is an address that is not one.
    #[test]
    fn taken_or_malformed_address() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap().to_string();
        let e = bind(&addr).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(&addr), "{e}");
        let e = bind("localhost").unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("IP:PORT"), "{e}");
    }
}
