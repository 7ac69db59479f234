"""The HTTPS line's join token: encoding and decoding, refusals of a mangled one, expiry, and the HMAC proofs.

``decode`` must give back every field ``encode`` wrote and refuse, with a ``LabConfigError`` that says what to
do, anything that is not a whole token of an HTTPS line. Expiry is only reported here (``expired``): the join
command and the hub refuse an expired token. ``prove``/``proof_holds`` are the challenge both ends answer.
"""

import base64
import json
import time

import pytest

from labkit.line import token as tokens
from labkit.line.token import PREFIX, LineToken, decode, is_line_token, proof_holds, prove
from labkit.spec.errors import LabConfigError

SECRET = "00112233445566778899aabbccddeeff" * 2
PIN = "ab" * 32


def make(**changes) -> LineToken:
    fields = dict(url="wss://hub.example.org:8443/labkit/line", lab="lab-42", secret=SECRET,
                  expires=time.time() + 3600, pin=PIN)
    fields.update(changes)
    return LineToken(**fields)


def raw(fields) -> str:
    """A token whose body is ``fields`` as JSON, made by hand (not by ``encode``)."""
    return PREFIX + base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")


# -- encode / decode --------------------------------------------------------------------


def test_a_token_decodes_to_the_token_that_was_encoded():
    token = make()
    assert decode(token.encode()) == token


def test_a_token_without_a_pin_decodes_with_pin_none():
    token = make(pin=None)
    assert decode(token.encode()).pin is None
    assert decode(token.encode()) == token


def test_an_encoded_token_starts_with_the_prefix_and_is_one_url_safe_word():
    text = make(lab="a lab/with+odd=characters?").encode()
    assert text.startswith(PREFIX) and tokens.PREFIX == "lkline1."
    body = text.removeprefix(PREFIX)
    assert "=" not in body and "+" not in body and "/" not in body and not any(c.isspace() for c in body)


@pytest.mark.parametrize("lab", ["x", "xy", "xyz", "xyzw"])
def test_a_token_decodes_whatever_padding_its_base64_had_stripped(lab):
    token = make(lab=lab)
    assert decode(token.encode()) == token


def test_a_token_pasted_with_whitespace_around_it_still_decodes():
    token = make()
    assert decode(f"  \n{token.encode()}\t \n") == token


def test_the_same_token_always_encodes_to_the_same_text():
    assert make(expires=1e9).encode() == make(expires=1e9).encode()


def test_the_expiry_comes_back_as_a_float_even_from_an_integer():
    fields = {"url": "wss://h:1/labkit/line", "lab": "l", "secret": SECRET, "expires": 2000000000}
    decoded = decode(raw(fields))
    assert decoded.expires == 2e9 and isinstance(decoded.expires, float)


def test_a_token_without_a_pin_field_at_all_decodes_with_pin_none():
    assert decode(raw({"url": "wss://h:1/labkit/line", "lab": "l", "secret": SECRET, "expires": 1})).pin is None


# -- refusals ---------------------------------------------------------------------------


def refused(text: str) -> str:
    with pytest.raises(LabConfigError) as caught:
        decode(text)
    return str(caught.value)


@pytest.mark.parametrize("mangle", [
    lambda text: text[:len(text) // 2],  # cut in half by a copy
    lambda text: text[:-1],  # its last character lost (base64 of a truncated JSON, or bad padding)
    lambda text: text[:len(PREFIX) + 10],
    lambda text: PREFIX,
    lambda text: "",
    lambda text: PREFIX + "!!!!not base64 at all!!!!",
    lambda text: text[:20] + "A" + text[21:],  # one character changed
], ids=["half", "last-character", "ten-characters", "prefix-only", "empty", "garbage", "one-character"])
def test_a_mangled_token_is_refused_with_a_message_that_says_to_copy_the_whole_command(mangle):
    message = refused(mangle(make(expires=2e9).encode()))  # a fixed token: each mangling is the same every run
    assert "not a whole join token" in message and "copy the whole command" in message


@pytest.mark.parametrize("missing", ["url", "lab", "secret", "expires"])
def test_a_token_missing_a_field_is_refused(missing):
    fields = {"url": "wss://h:1/labkit/line", "lab": "l", "secret": SECRET, "expires": 1}
    del fields[missing]
    assert "not a whole join token" in refused(raw(fields))


@pytest.mark.parametrize("secret", ["not hex", "abc", None, 12])
def test_a_token_whose_secret_is_not_hex_is_refused(secret):
    assert "not a whole join token" in refused(raw({"url": "wss://h:1/labkit/line", "lab": "l", "secret": secret,
                                                    "expires": 1}))


@pytest.mark.parametrize("expires", ["tomorrow", None, [1]])
def test_a_token_whose_expiry_is_not_a_number_is_refused(expires):
    assert "not a whole join token" in refused(raw({"url": "wss://h:1/labkit/line", "lab": "l", "secret": SECRET,
                                                    "expires": expires}))


@pytest.mark.parametrize("body", [[1, 2], "a string", 7, None])
def test_a_token_whose_body_is_not_an_object_is_refused(body):
    assert "not a whole join token" in refused(raw(body))


def test_a_token_whose_body_is_not_utf8_is_refused():
    assert "not a whole join token" in refused(PREFIX + base64.urlsafe_b64encode(b"\xff\xfe\x00{").decode())


@pytest.mark.parametrize("url", ["ws://hub:8080/labkit/line", "https://hub/labkit/line", "hub:8443"])
def test_a_token_that_names_no_wss_address_is_refused_and_the_message_names_the_address(url):
    message = refused(make(url=url).encode())
    assert repr(url) in message and "not an HTTPS (wss://) address" in message


def test_a_token_whose_url_is_not_a_string_is_refused():
    refused(raw({"url": 443, "lab": "l", "secret": SECRET, "expires": 1}))


# -- expiry -----------------------------------------------------------------------------


def test_a_token_whose_expiry_has_passed_is_expired():
    assert make(expires=time.time() - 1).expired


def test_a_token_whose_expiry_is_ahead_is_not_expired():
    assert not make(expires=time.time() + 60).expired


def test_an_expired_token_still_decodes_so_the_join_command_can_say_it_expired():
    token = make(expires=time.time() - 3600)
    assert decode(token.encode()).expired


def test_a_token_is_frozen():
    with pytest.raises(AttributeError):
        make().expires = 0.0  # type: ignore[misc]


# -- is_line_token ----------------------------------------------------------------------


def test_a_line_token_is_recognised_with_or_without_whitespace_around():
    assert is_line_token(make().encode())
    assert is_line_token("  " + make().encode() + "\n")


@pytest.mark.parametrize("text", ["", "lkline2.abc", "LKLINE1.abc", "host:port:key", "x lkline1.abc"])
def test_other_text_is_not_a_line_token(text):
    assert not is_line_token(text)


# -- proofs -----------------------------------------------------------------------------


def test_a_proof_is_the_hmac_sha256_of_who_and_the_nonce_under_the_secret():
    import hashlib
    import hmac

    expected = hmac.new(bytes.fromhex(SECRET), b"site:n0nce", hashlib.sha256).hexdigest()
    assert prove(SECRET, "n0nce", "site") == expected
    assert make().proof("n0nce", "site") == expected


def test_a_proof_made_with_the_secret_holds():
    assert proof_holds(SECRET, "nonce-1", "site", make().proof("nonce-1", "site"))


def test_a_proof_made_with_another_secret_does_not_hold():
    other = make(secret="ff" * 32)
    assert not proof_holds(SECRET, "nonce-1", "site", other.proof("nonce-1", "site"))


def test_a_proof_for_another_nonce_does_not_hold():
    assert not proof_holds(SECRET, "nonce-2", "site", prove(SECRET, "nonce-1", "site"))


def test_the_hubs_proof_does_not_pass_for_the_sites_and_back():
    # Otherwise a hub (or a site) could replay the other's answer to the same nonce.
    assert prove(SECRET, "n", "hub") != prove(SECRET, "n", "site")
    assert not proof_holds(SECRET, "n", "site", prove(SECRET, "n", "hub"))
    assert not proof_holds(SECRET, "n", "hub", prove(SECRET, "n", "site"))


def test_a_proof_with_one_character_changed_does_not_hold():
    proof = prove(SECRET, "n", "site")
    changed = proof[:-1] + ("0" if proof[-1] != "0" else "1")
    assert not proof_holds(SECRET, "n", "site", changed)


@pytest.mark.parametrize("proof", [None, 12, b"bytes", ["list"], {"proof": "x"}, ""])
def test_a_proof_that_is_not_a_hex_string_does_not_hold(proof):
    assert proof_holds(SECRET, "n", "site", proof) is False
