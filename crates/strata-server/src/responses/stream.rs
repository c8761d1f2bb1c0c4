//! A streamed response: the chat path's SSE stream read chunk by chunk and rewritten as
//! Responses events (`event:` + `data:` with `sequence_number`), keeping its proxy headers.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};

use super::output::{ChatStreamData, OutputBuilder};
use super::types::{ResponseStreamEvent, StreamEvent};
use crate::error::ErrorDetail;

/// The SSE response of a streamed response, from the chat path's SSE response `chat`: its
/// headers (which keep proxies from buffering) are kept; its keep-alive comments are replaced
/// by this stream's own.
pub fn sse_response(chat: Response, builder: OutputBuilder, keep_alive: Duration) -> Response {
    let (parts, body) = chat.into_parts();
    let events = ResponseEvents {
        pending: builder.opening().into(),
        builder,
        chat: ChatSse::new(body),
        sequence: 0,
        done: false,
    };
    let stream = stream::unfold(events, |mut events| async move {
        let event = events.next_event().await?;
        Some((Ok::<Event, Infallible>(event), events))
    });
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(keep_alive).text("keep-alive"))
        .into_response();
    *response.headers_mut() = parts.headers;
    response
}

/// The `data:` payloads of an SSE body, comments skipped.
struct ChatSse {
    body: BodyDataStream,
    buffer: Vec<u8>,
}

impl ChatSse {
    fn new(body: Body) -> Self {
        ChatSse {
            body: body.into_data_stream(),
            buffer: Vec::new(),
        }
    }

    /// The next event's data; `None` at the end of the body.
    async fn next_data(&mut self) -> Option<Result<String, axum::Error>> {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let block = String::from_utf8_lossy(&block);
                let data: Vec<&str> = block
                    .lines()
                    .filter_map(|line| line.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if !data.is_empty() {
                    return Some(Ok(data.join("\n")));
                }
                continue;
            }
            match self.body.next().await? {
                Ok(bytes) => self.buffer.extend_from_slice(&bytes),
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// The state of one streamed response.
struct ResponseEvents {
    builder: OutputBuilder,
    chat: ChatSse,
    pending: VecDeque<StreamEvent>,
    sequence: u64,
    done: bool,
}

impl ResponseEvents {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(self.numbered(event));
            }
            if self.done {
                return None;
            }
            let events = match self.chat.next_data().await {
                Some(Ok(data)) if data == "[DONE]" => self.builder.closing(),
                Some(Ok(data)) => match serde_json::from_str::<ChatStreamData>(&data) {
                    Ok(chunk) => self.builder.chunk(chunk),
                    Err(e) => self.fail(format!("the chat stream sent an unreadable chunk: {e}")),
                },
                Some(Err(e)) => self.fail(format!("the chat stream failed: {e}")),
                None => self.builder.closing(),
            };
            self.pending.extend(events);
            self.done = self.builder.ended();
        }
    }

    fn fail(&mut self, message: String) -> Vec<StreamEvent> {
        self.builder.failed(&ErrorDetail {
            message,
            kind: "server_error".into(),
            param: None,
            code: None,
        })
    }

    /// The SSE event of `event`, with the next sequence number.
    fn numbered(&mut self, event: StreamEvent) -> Event {
        let sequenced = ResponseStreamEvent {
            sequence_number: self.sequence,
            event,
        };
        self.sequence += 1;
        let data = serde_json::to_value(&sequenced).unwrap_or_default();
        let name = data["type"].as_str().unwrap_or("message").to_string();
        Event::default().event(name).data(data.to_string())
    }
}
