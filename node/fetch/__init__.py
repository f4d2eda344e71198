"""Download once: a node without the model fetches just its own layers from a peer that has it.

- `manifest`: what a model consists of, as pieces of files (small files whole, file headers, each tensor's bytes,
  big tensors in blocks), each labelled with the layer (or embedding/norm/head) it belongs to.
- `layout`: builds a manifest from a model on disk (GGUF file or Hugging Face folder), reading only headers.
- `hashes`: the serving side's sha256 of each piece, computed on first request and cached on disk.
- `seal`: with a cluster key, manifests carry every piece's sha256 and are signed (HMAC) under it.
- `source`: the serving side: which pieces exist, who may have them, how fast and how many at once.
- `local_copy`: the fetching side's copy, the model's files at full size as sparse files holding only the pieces
  fetched and verified so far, and a record of those pieces that survives restarts.
- `fetcher`: fetches pieces from the peers that serve the model: verifies each one, retries, moves to another peer.
- `follow`: keeps a node holding the layers the cluster assigns it.
- `startup`: `exo-node --model ID` for a model this node doesn't have.
"""
