"""The data link: the data path's messages on TCP frames between peers (server.py says why), the gRPC stream's
messages and answers, in order; mutual TLS with a cluster key."""
