"""Black-box tests of the pagewire server (HTTP, WebSocket, ledger) and unit tests of its edge modules."""
