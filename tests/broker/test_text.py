from syshax.broker.text import as_text


def test_replies_become_text_and_bad_bytes_never_raise():
    assert as_text(b"gw-1") == "gw-1"
    assert as_text(bytearray(b"ab")) == "ab"
    assert as_text(b"\xff ok") == "\ufffd ok"  # a name from outside the farm: never an error
    assert as_text(None) == ""
    assert as_text("already") == "already"
    assert as_text(17) == "17"
