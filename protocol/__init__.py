"""The wire protocol between peers: versioned msgpack messages, signatures, and the round protocol
on hivemind's P2P streams and DHT. It may import `groundswell.compression`, never `optim` or `peer`."""
