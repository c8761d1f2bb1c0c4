//! The output thread: it owns the delivery of every message the engine sends to a request's stream.
//! The engine posts a step's messages to the [`Outbox`] and hands them over in one send, off its critical path.

use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;

use tokio::sync::mpsc::UnboundedSender;

use crate::request::RequestOutput;

/// One message bound for one stream.
struct Letter {
    to: UnboundedSender<RequestOutput>,
    out: RequestOutput,
}

/// Messages waiting for the next [`Outbox::flush`], and the output thread that delivers them in
/// the order they were posted (one thread, one FIFO channel: each stream's order is kept).
/// Dropping it delivers what is left and joins the thread.
pub struct Outbox {
    pending: Vec<Letter>,
    to_thread: Option<Sender<Vec<Letter>>>,
    thread: Option<JoinHandle<()>>,
}

impl Outbox {
    /// Starts the output thread.
    pub fn start() -> std::io::Result<Outbox> {
        let (to_thread, from_engine) = mpsc::channel::<Vec<Letter>>();
        let thread = std::thread::Builder::new()
            .name("strata-output".into())
            .spawn(move || {
                while let Ok(letters) = from_engine.recv() {
                    deliver(letters);
                }
            })?;
        Ok(Outbox {
            pending: Vec::new(),
            to_thread: Some(to_thread),
            thread: Some(thread),
        })
    }

    /// Queues `out` for the stream behind `to`; it leaves at the next [`Self::flush`].
    pub fn post(&mut self, to: &UnboundedSender<RequestOutput>, out: RequestOutput) {
        self.pending.push(Letter { to: to.clone(), out });
    }

    /// Hands everything posted so far to the output thread in one send. Should the thread be
    /// gone, the messages are delivered here instead, still in order.
    pub fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let letters = std::mem::take(&mut self.pending);
        match &self.to_thread {
            Some(tx) => {
                if let Err(mpsc::SendError(letters)) = tx.send(letters) {
                    deliver(letters);
                }
            }
            None => deliver(letters),
        }
    }

    /// Flushes, lets the output thread finish what it holds and waits for it: every message
    /// posted has reached its stream when this returns.
    pub fn close(&mut self) {
        self.flush();
        self.to_thread = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        self.close();
    }
}

/// Sends each letter on its stream; a stream whose caller went away drops it.
fn deliver(letters: Vec<Letter>) {
    for Letter { to, out } in letters {
        let _ = to.send(out);
    }
}
