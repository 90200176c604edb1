"""Transports the services share: the HTTP/1.1 client pool and the ZMTP subscriber."""
