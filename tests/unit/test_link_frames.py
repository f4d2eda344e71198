"""The data link's frames: whatever pieces the bytes arrive in, the same frames come out in order; a frame over the
bound or of an unknown kind is refused from its header, before its payload is held."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.grpc.link.frames import DATA, ERROR, HEADER, FrameError, FrameReader, frame

frames = st.lists(st.tuples(st.sampled_from([DATA, ERROR]), st.binary(max_size=300)), max_size=12)


@given(frames, st.lists(st.integers(min_value=0, max_value=4000), max_size=20))
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_cut(sent, cuts):
    stream = b"".join(frame(kind, payload) for kind, payload in sent)
    reader, got, at = FrameReader(300), [], 0
    for cut in sorted({min(c, len(stream)) for c in cuts}) + [len(stream)]:
        got += reader.feed(stream[at:cut])
        at = cut
    assert got == sent and reader.pending == 0


def test_a_frame_over_the_bound_is_refused_from_its_header_alone():
    reader = FrameReader(1000)
    with pytest.raises(FrameError, match="1001 bytes, over the bound of 1000"):
        reader.feed(HEADER.pack(1001, DATA))  # not one byte of its payload was needed to refuse it


def test_an_unknown_kind_is_refused():
    with pytest.raises(FrameError, match="unknown frame kind 7"):
        FrameReader(100).feed(HEADER.pack(0, 7))
    with pytest.raises(ValueError, match="frame kind"):
        frame(7, b"")


def test_a_half_frame_is_held_until_its_rest_comes():
    reader = FrameReader(100)
    whole = frame(DATA, b"0123456789")
    assert reader.feed(whole[:8]) == [] and reader.pending == 8
    assert reader.feed(whole[8:]) == [(DATA, b"0123456789")] and reader.pending == 0
