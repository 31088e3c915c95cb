"""Containers: snapshots <-> bytes on disk and on the wire.

* :mod:`.schema`: the snapshot's records (layers, metadata, token ids, scales);
* :mod:`.stream`: ``.hrrs`` streams and the per-layer writer;
* :mod:`.hrryfile`: ``.hrry`` files (header, aligned buffers, index, trailer);
* :mod:`.template`: ``.hrry`` snapshots whose structure a file read before had, loaded without re-parsing it;
* :mod:`.safetensors`: ``.safetensors`` files;
* :mod:`.io`: ``save`` / ``load`` / ``detect_format`` over all of them;
* :mod:`.check`: ``validate`` a file or stream without loading it.
"""

__all__: list[str] = []  # the modules are the API: import from them
