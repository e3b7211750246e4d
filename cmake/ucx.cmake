# Optional UCX one-sided path: the kvbridge_ucx library (csrc/ucx) and the
# kvbridge._ucx Python module.  UCX is found in this order: UCX_HOME, then the
# libucx wheel of the Python interpreter (pip install libucx-cu12 / ucxx-cu12),
# then the system.  With KVBRIDGE_WITH_UCX=AUTO a missing UCX only skips the
# module (kvbridge then reports UCX unavailable); with ON it is an error.
set(KVBRIDGE_HAS_UCX OFF)
set(KVBRIDGE_UCX_REASON "")
if(NOT KVBRIDGE_WITH_UCX STREQUAL "OFF")
  set(_kvb_ucx_hints "")
  if(DEFINED ENV{UCX_HOME})
    list(APPEND _kvb_ucx_hints "$ENV{UCX_HOME}")
  endif()
  if(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "import libucx, os; print(os.path.dirname(libucx.__file__))"
      OUTPUT_VARIABLE _kvb_libucx_dir OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _kvb_libucx_rc ERROR_QUIET)
    if(_kvb_libucx_rc EQUAL 0 AND EXISTS "${_kvb_libucx_dir}/include/ucp/api/ucp.h")
      list(APPEND _kvb_ucx_hints "${_kvb_libucx_dir}")
    endif()
  endif()
  find_path(KVBRIDGE_UCP_INCLUDE_DIR ucp/api/ucp.h HINTS ${_kvb_ucx_hints} PATH_SUFFIXES include)
  find_library(KVBRIDGE_UCP_LIBRARY ucp HINTS ${_kvb_ucx_hints} PATH_SUFFIXES lib lib64)
  find_library(KVBRIDGE_UCS_LIBRARY ucs HINTS ${_kvb_ucx_hints} PATH_SUFFIXES lib lib64)
  if(KVBRIDGE_UCP_INCLUDE_DIR AND KVBRIDGE_UCP_LIBRARY AND KVBRIDGE_UCS_LIBRARY)
    set(KVBRIDGE_HAS_UCX ON)
  else()
    set(KVBRIDGE_UCX_REASON "UCP headers or libucp/libucs not found (set UCX_HOME or pip install libucx-cu12)")
    if(KVBRIDGE_WITH_UCX STREQUAL "ON")
      message(FATAL_ERROR "KVBRIDGE_WITH_UCX=ON but ${KVBRIDGE_UCX_REASON}")
    endif()
  endif()
endif()
message(STATUS "kvbridge: UCX path ${KVBRIDGE_HAS_UCX} ${KVBRIDGE_UCX_REASON}")

if(KVBRIDGE_HAS_UCX)
  add_library(kvbridge_ucx STATIC
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ucx/engine.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ucx/expect.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ucx/messages.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ucx/progress.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ucx/runs.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/ucx/transfer.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/csrc/xxh3.cpp)
  target_include_directories(kvbridge_ucx
    PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc ${KVBRIDGE_UCP_INCLUDE_DIR})
  find_package(Threads REQUIRED)
  target_link_libraries(kvbridge_ucx
    PUBLIC ${KVBRIDGE_UCP_LIBRARY} ${KVBRIDGE_UCS_LIBRARY} Threads::Threads)

  if(KVBRIDGE_BUILD_PYTHON)
    nanobind_add_module(_ucx NB_STATIC ${CMAKE_CURRENT_SOURCE_DIR}/bindings/ucx.cpp)
    target_link_libraries(_ucx PRIVATE kvbridge_ucx)
    # Installed next to the libucx wheel (site-packages/kvbridge and
    # site-packages/libucx); kvbridge also preloads libucx before importing.
    get_filename_component(_kvb_ucp_libdir "${KVBRIDGE_UCP_LIBRARY}" DIRECTORY)
    set_target_properties(_ucx PROPERTIES
      BUILD_RPATH "${_kvb_ucp_libdir}"
      INSTALL_RPATH "$ORIGIN/../libucx/lib;${_kvb_ucp_libdir}")
    install(TARGETS _ucx LIBRARY DESTINATION kvbridge)
  endif()
endif()
