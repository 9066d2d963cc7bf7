"""Builds the compiled core of the history drafter (everything else is in pyproject.toml)."""
from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(ext_modules=[Pybind11Extension("rhymerl.drafting._suffix_core", ["rhymerl/drafting/_suffix_core.cpp"],
                                     cxx_std=17, extra_compile_args=["-O3"])])
