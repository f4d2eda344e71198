"""The data link: the data path's messages on plain TCP frames between peers without a cluster key (server.py
says why), the gRPC stream's messages and answers, in order."""
