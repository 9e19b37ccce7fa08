# `cmake --install`: the SDK (docs/sdk.md). The shared and the static client library, the
# public headers only, the daemons and tools, a CMake package (find_package(shardps) ->
# shardps::shardps, shardps::shardps_static) and a pkg-config file; CPack makes a .deb of it.
include(CMakePackageConfigHelpers)

set(SHARDPS_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardps)

# Libraries.
install(TARGETS shardps_shared LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${SHARDPS_SDK_ARCHIVE} DESTINATION ${CMAKE_INSTALL_LIBDIR})

# Public headers: worker/include/shardps/ and the generated version.h; nothing internal.
install(FILES worker/include/shardps/client.h worker/include/shardps/status.h
              worker/include/shardps/c_api.h worker/include/shardps/export.h
              ${PROJECT_BINARY_DIR}/include/shardps/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardps)

# Daemons and tools (the `shardps` tool installs itself in tools/).
install(TARGETS shardps_server shardps_coordinator_bin shardps_checkpoint_cli shardps_plan
        shardps_aggregator
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# The CMake package. The static library pins the protobuf it was generated with.
find_package(Protobuf REQUIRED)
set(SHARDPS_PROTOBUF_VERSION ${Protobuf_VERSION})
configure_package_config_file(cmake/shardpsConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/sdk/shardpsConfig.cmake
                              INSTALL_DESTINATION ${SHARDPS_CMAKE_DIR}
                              PATH_VARS CMAKE_INSTALL_INCLUDEDIR CMAKE_INSTALL_LIBDIR
                                        CMAKE_INSTALL_BINDIR)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/sdk/shardpsConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/sdk/shardpsConfig.cmake
              ${PROJECT_BINARY_DIR}/sdk/shardpsConfigVersion.cmake
        DESTINATION ${SHARDPS_CMAKE_DIR})

# pkg-config: relocatable (prefix from the .pc file's own directory).
set(pc_dir ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
file(RELATIVE_PATH SHARDPS_PC_PREFIX_REL /prefix/${pc_dir} /prefix)
string(REGEX REPLACE "/$" "" SHARDPS_PC_PREFIX_REL "${SHARDPS_PC_PREFIX_REL}")
set(SHARDPS_PC_LIBS_PRIVATE "-lprotobuf -lglog -lgflags -lssl -lcrypto")
if(SHARDPS_HAVE_VERBS)
  string(APPEND SHARDPS_PC_LIBS_PRIVATE " -libverbs -lrdmacm")
endif()
if(SHARDPS_HAVE_CUDA)
  get_filename_component(cudart_dir "${CUDA_cudart_LIBRARY}" REALPATH)
  get_filename_component(cudart_dir "${cudart_dir}" DIRECTORY)
  string(APPEND SHARDPS_PC_LIBS_PRIVATE " -L${cudart_dir} -Wl,-rpath,${cudart_dir} -lcudart")
endif()
string(APPEND SHARDPS_PC_LIBS_PRIVATE " -lstdc++ -lm -lpthread")
set(SHARDPS_PC_REQUIRES_PRIVATE "protobuf = ${Protobuf_VERSION}")
configure_file(cmake/shardps.pc.in ${PROJECT_BINARY_DIR}/sdk/shardps.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/sdk/shardps.pc DESTINATION ${pc_dir})

install(FILES README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR} FILES_MATCHING PATTERN "*.md")

# CPack: `cpack -G DEB` in the build directory makes shardps_VERSION_ARCH.deb.
set(CPACK_PACKAGE_NAME shardps)
set(CPACK_PACKAGE_VENDOR "ShardPS")
set(CPACK_PACKAGE_CONTACT "ShardPS developers <shardps@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Parameter-server daemon over RDMA: servers, coordinator, tools and the client SDK")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_GENERATOR DEB)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
# Debian 12's runtime packages of the libraries the binaries need (dpkg-shlibdeps cannot be used:
# a CUDA build also needs libcudart from the CUDA toolkit, which no Debian package provides; the
# binaries find it through their RPATH).
set(deb_depends "libprotobuf32, libgoogle-glog0v6, libgflags2.2, libssl3")
if(SHARDPS_HAVE_VERBS)
  string(APPEND deb_depends ", libibverbs1, librdmacm1")
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${deb_depends}")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
include(CPack)
