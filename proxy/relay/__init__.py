"""The way back: an upstream's answer, as typed events, written to the client."""
