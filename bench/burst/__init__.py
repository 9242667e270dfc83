"""``llmproxy bench burst``: an editor's keystroke burst, direct vs through the proxy."""
