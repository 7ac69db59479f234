"""The site's join command refuses what cannot work before it dials anything: a bad count, name, file or token."""

import time

import pytest

from labkit.cluster.site_agent import run_site, site_info
from labkit.line.token import LineToken
from labkit.spec.errors import LabConfigError


def token(expires_in: float = 60.0) -> str:
    return LineToken("wss://198.18.0.1:8443/labkit/line", "lab1", "ab" * 32, time.time() + expires_in).encode()


@pytest.mark.parametrize("ranks, name, cafile, words", [
    (0, "home", None, "--ranks is how many ranks this site runs, 1 to 1024"),
    (2000, "home", None, "1 to 1024"),
    (1, "no spaces", None, "a site's name is 1 to 63 letters"),
    (1, "-dash-first", None, "starting with a letter or digit"),
    (1, "home", "/no/such/ca.pem", "--cafile /no/such/ca.pem: no such file"),
])
def test_a_join_command_that_cannot_work_is_refused_saying_why(ranks, name, cafile, words):
    with pytest.raises(LabConfigError, match=words):
        run_site(token(), ranks, name, cafile)


def test_an_expired_join_command_says_to_print_a_new_one():
    with pytest.raises(LabConfigError, match="expired: print a new one"):
        run_site(token(expires_in=-1), 1, "home")


def test_a_mangled_token_says_to_copy_the_whole_command():
    with pytest.raises(LabConfigError, match="copy the whole command"):
        run_site("lkline1.not-a-token", 1, "home")


def test_what_a_site_says_of_itself():
    info = site_info(2)
    assert info["ranks"] == 2 and info["cores"] >= 1 and isinstance(info["gpus"], list) and info["host"]
