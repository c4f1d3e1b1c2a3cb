"""The package list (everything else is in pyproject.toml): ``engine``, ``conformance``, and the repository's
``fixtures/`` folder installed under the import name ``engine_fixtures``, so that installing this package never
shadows PyPI's ``fixtures`` (testing-cabal), which many test suites import."""

from setuptools import find_packages, setup

FIXTURES = "engine_fixtures"
fixture_packages = [FIXTURES] + [f"{FIXTURES}.{name}" for name in find_packages(where="fixtures")]
setup(
    packages=find_packages(include=["engine", "engine.*", "conformance", "conformance.*"]) + fixture_packages,
    package_dir={FIXTURES: "fixtures"},
)
