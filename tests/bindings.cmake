# Bindings (Python, Go, Rust) and downstream consumers (pkg-config, CMake),
# all tested against an installed tree: the first test installs this build
# into ${DZ_TEST_PREFIX}; the others need it (fixture dz_install).
#
# The C example program (examples/simple/simple.c) built in-tree is the
# reference: each binding greedy-generates on the tiny fixture model and must
# produce exactly the ids it prints for the same prompt.

set(DZ_TEST_PREFIX ${PROJECT_BINARY_DIR}/test-install)
set(DZ_BIND_WORK ${PROJECT_BINARY_DIR}/bindings)
set(DZ_TEST_MODEL ${PROJECT_SOURCE_DIR}/tests/data/gpt_oss_tiny)

add_executable(dz_simple ${PROJECT_SOURCE_DIR}/examples/simple/simple.c)
target_link_libraries(dz_simple PRIVATE dayzero)
set_target_properties(dz_simple PROPERTIES C_STANDARD 90 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
target_compile_options(dz_simple PRIVATE -pedantic -Wall -Wextra -Werror)

add_test(NAME install_tree
  COMMAND ${CMAKE_COMMAND} -E env bash -c "rm -rf '${DZ_TEST_PREFIX}' && '${CMAKE_COMMAND}' --install '${PROJECT_BINARY_DIR}' --prefix '${DZ_TEST_PREFIX}' >/dev/null && test -f '${DZ_TEST_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig/dayzero.pc'")
set_tests_properties(install_tree PROPERTIES FIXTURES_SETUP dz_install TIMEOUT 120)

# The tiny model with a tokenizer made to fit it, for the bindings' text paths.
find_program(DZ_PYTHON python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT DZ_PYTHON)
  find_program(DZ_PYTHON python3)
endif()
set(DZ_TEST_TEXT_MODEL ${DZ_BIND_WORK}/gpt_oss_tiny_tok)
add_test(NAME bindings_text_model COMMAND ${DZ_PYTHON} ${PROJECT_SOURCE_DIR}/bindings/tiny_model_with_tokenizer.py
  ${DZ_TEST_MODEL} ${DZ_TEST_TEXT_MODEL})
set_tests_properties(bindings_text_model PROPERTIES FIXTURES_SETUP dz_text_model TIMEOUT 60)

# Environment shared by the binding tests.
set(DZ_BIND_ENV
  PKG_CONFIG_PATH=${DZ_TEST_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig
  LD_LIBRARY_PATH=${DZ_TEST_PREFIX}/${CMAKE_INSTALL_LIBDIR}
  DAYZERO_TEST_PREFIX=${DZ_TEST_PREFIX}
  DAYZERO_TEST_MODEL=${DZ_TEST_MODEL}
  DAYZERO_TEST_TEXT_MODEL=${DZ_TEST_TEXT_MODEL}
  DAYZERO_TEST_REFERENCE=$<TARGET_FILE:dz_simple>
  DAYZERO_TEST_HEADER=${PROJECT_SOURCE_DIR}/include/dayzero.h)

# A missing toolchain fails its test loudly (tools/bootstrap.sh installs them).
function(dz_missing_tool_test name what)
  add_test(NAME ${name} COMMAND bash -c "echo '${what} not found: run tools/bootstrap.sh (it installs it)'; exit 1")
endfunction()

# ---------------------------------------------------------------- consumers
foreach(mode pkgconfig cmake)
  add_test(NAME consumer_${mode}
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/consumers/consumer.sh ${mode} ${DZ_TEST_PREFIX}
      ${DZ_BIND_WORK}/consumer-${mode} ${PROJECT_SOURCE_DIR}/examples/simple/simple.c ${DZ_TEST_MODEL}
      ${CMAKE_C_COMPILER})
  set_tests_properties(consumer_${mode} PROPERTIES FIXTURES_REQUIRED dz_install TIMEOUT 300)
endforeach()

# ---------------------------------------------------------------- Python
# Debian's python3 has python3-numpy (tools/bootstrap.sh); prefer it so the
# numpy path is tested.
if(DZ_PYTHON)
  add_test(NAME binding_python
    COMMAND ${CMAKE_COMMAND} -E env --unset=DAYZERO_LIB ${DZ_BIND_ENV} DAYZERO_TEST_REQUIRE_NUMPY=1
      PYTHONDONTWRITEBYTECODE=1 ${DZ_PYTHON} -m unittest discover -s tests -v
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/bindings/python)
else()
  dz_missing_tool_test(binding_python python3)
endif()
set_tests_properties(binding_python PROPERTIES FIXTURES_REQUIRED "dz_install;dz_text_model" TIMEOUT 300)

# ---------------------------------------------------------------- Go
find_program(DZ_GO go)
if(DZ_GO)
  add_test(NAME binding_go
    COMMAND ${CMAKE_COMMAND} -E env ${DZ_BIND_ENV} GOFLAGS=-mod=mod GOPROXY=off GO111MODULE=on CGO_ENABLED=1
      GOTOOLCHAIN=local GOCACHE=${DZ_BIND_WORK}/go-cache GOPATH=${DZ_BIND_WORK}/gopath CC=${CMAKE_C_COMPILER}
      ${DZ_GO} test -count=1 -v ./...
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/bindings/go/dayzero)
else()
  dz_missing_tool_test(binding_go "go (Debian package golang-go)")
endif()
set_tests_properties(binding_go PROPERTIES FIXTURES_REQUIRED "dz_install;dz_text_model" TIMEOUT 300)

# ---------------------------------------------------------------- Rust
find_program(DZ_CARGO cargo HINTS $ENV{HOME}/.cargo/bin)
if(DZ_CARGO)
  get_filename_component(_dz_cargo_dir ${DZ_CARGO} DIRECTORY)
  add_test(NAME binding_rust
    COMMAND ${CMAKE_COMMAND} -E env ${DZ_BIND_ENV} CARGO_TARGET_DIR=${DZ_BIND_WORK}/rust-target
      "PATH=${_dz_cargo_dir}:$ENV{PATH}" ${DZ_CARGO} test --offline --locked
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/bindings/rust)
else()
  dz_missing_tool_test(binding_rust "cargo (Debian packages rustc, cargo)")
endif()
set_tests_properties(binding_rust PROPERTIES FIXTURES_REQUIRED "dz_install;dz_text_model" TIMEOUT 300)
