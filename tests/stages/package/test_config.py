"""``package.kserve.storage_uri`` is checked when the config is read, against the schemes the manifest check takes."""

import pytest

from kiln.core.errors import ConfigError
from kiln.pipeline.config import config_from_dict
from kiln.stages.package.config import STORAGE_SCHEMES


def test_local_storage_uri_is_refused_at_config_load() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"package": {"kserve": {"storage_uri": "/local/path"}}})
    assert "/local/path" in err.value.message and "s3://" in err.value.message
    assert err.value.hint is not None and "package.kserve.storage_uri" in err.value.hint


@pytest.mark.parametrize("scheme", STORAGE_SCHEMES)
def test_every_manifest_scheme_is_taken(scheme: str) -> None:
    cfg = config_from_dict({"package": {"kserve": {"storage_uri": f"{scheme}bucket/triton"}}})
    assert cfg.package.kserve.storage_uri == f"{scheme}bucket/triton"


def test_storage_uri_is_not_checked_when_kserve_is_off() -> None:
    cfg = config_from_dict({"package": {"kserve": {"enabled": False, "storage_uri": "/local/path"}}})
    assert cfg.package.kserve.storage_uri == "/local/path"
