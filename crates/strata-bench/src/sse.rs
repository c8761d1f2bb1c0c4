//! Incremental Server-Sent Events parser for OpenAI-style streams.
//! Owns turning raw body bytes into `data:` payloads, whatever the read boundaries are.

/// Splits a byte stream into SSE events; feed it reads in order, then call [`SseParser::finish`].
#[derive(Debug, Default)]
pub struct SseParser {
    pending: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes one read; calls `on_event` with the data of every event completed by it.
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(&[u8])) {
        self.pending.extend_from_slice(bytes);
        let mut consumed = 0;
        while let Some(offset) = self.pending[consumed..].iter().position(|&b| b == b'\n') {
            let end = consumed + offset;
            let mut line = &self.pending[consumed..end];
            if let [rest @ .., b'\r'] = line {
                line = rest;
            }
            Self::take_line(line, &mut self.data, &mut self.has_data, &mut on_event);
            consumed = end + 1;
        }
        self.pending.drain(..consumed);
    }

    /// Ends the stream: a last line without a newline and an event without its blank line still count.
    pub fn finish(&mut self, mut on_event: impl FnMut(&[u8])) {
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            let line = line.strip_suffix(b"\r").unwrap_or(&line);
            Self::take_line(line, &mut self.data, &mut self.has_data, &mut on_event);
        }
        Self::take_line(b"", &mut self.data, &mut self.has_data, &mut on_event);
    }

    fn take_line(line: &[u8], data: &mut Vec<u8>, has_data: &mut bool, on_event: &mut impl FnMut(&[u8])) {
        if line.is_empty() {
            if *has_data {
                on_event(data);
                data.clear();
                *has_data = false;
            }
            return;
        }
        if line[0] == b':' {
            return; // comment / keep-alive
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if *has_data {
                data.push(b'\n');
            }
            data.extend_from_slice(value);
            *has_data = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<String> {
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        for chunk in input.chunks(piece.max(1)) {
            parser.feed(chunk, |d| events.push(String::from_utf8_lossy(d).into_owned()));
        }
        parser.finish(|d| events.push(String::from_utf8_lossy(d).into_owned()));
        events
    }

    #[test]
    fn events_survive_every_split() {
        let input = b": keep-alive\n\ndata: {\"a\":1}\n\nevent: x\ndata:{\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        for piece in 1..input.len() {
            assert_eq!(
                parse_in_pieces(input, piece),
                vec!["{\"a\":1}", "{\"b\":2}", "[DONE]"],
                "piece size {piece}"
            );
        }
    }

    #[test]
    fn multi_line_data_is_joined_with_newlines() {
        assert_eq!(parse_in_pieces(b"data: one\ndata: two\n\n", 100), vec!["one\ntwo"]);
    }

    #[test]
    fn a_last_event_without_blank_line_is_kept() {
        assert_eq!(parse_in_pieces(b"data: x\n\ndata: [DONE]", 3), vec!["x", "[DONE]"]);
    }

    #[test]
    fn comments_and_other_fields_are_ignored() {
        assert!(parse_in_pieces(b": ping\nid: 4\nretry: 10\n\n", 5).is_empty());
    }
}
