//! Stop strings matched across token boundaries: text is held back while it could still be
//! the start of a stop string.

/// Finds stop strings in streamed text, holding back any tail that could begin one.
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    held: String,
    pub(crate) matched: Option<String>,
}

impl StopMatcher {
    pub(crate) fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, held: String::new(), matched: None }
    }

    /// Returns the text that is safe to emit, and whether a stop string was found.
    pub(crate) fn push(&mut self, delta: &str) -> (String, bool) {
        self.held.push_str(delta);
        if let Some((at, stop)) =
            self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at)
        {
            let out = self.held[..at].to_string();
            self.matched = Some(stop.clone());
            self.held.clear();
            return (out, true);
        }
        let keep = (1..=self.held.len())
            .rev()
            .filter(|&n| self.held.is_char_boundary(self.held.len() - n))
            .find(|&n| {
                let tail = &self.held[self.held.len() - n..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    pub(crate) fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_split_across_deltas() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), ("hello ".into(), false));
        assert_eq!(m.push("N"), ("".into(), false));
        assert_eq!(m.push("D tail"), ("".into(), true));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("EN"), ("".into(), false));
        assert_eq!(m.push("x é"), ("ENx é".into(), false));
        assert_eq!(m.flush(), "");
    }
}
