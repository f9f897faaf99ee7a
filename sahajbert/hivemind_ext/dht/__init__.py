"""The DHT node's bounds (records it stores, requests it answers) and the DHT process's request pipe."""
